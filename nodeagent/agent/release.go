package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// removeFromMesh undoes everything enrollment did for a pod that still
// exists (it left the mesh, or --fail-pending rolls it back). Every step is
// idempotent; on error the pod stays registered and is retried.
//
// The rules go first and ztunnel is told only once they are gone: a pod
// whose rules cannot be deleted (its netns not found, iptables failing)
// still has its traffic captured, so it stays in ztunnel, in the registry
// and annotated, and is retried, rather than being left captured with
// nobody proxying it.
func (a *Agent) removeFromMesh(ctx context.Context, log *slog.Logger, pod *corev1.Pod, e registry.Entry, reason string) error {
	if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
		if e.Netns == nil {
			e.IPs = podmeta.IPs(pod) // its current sandbox is the one to clean
		}
		withNS, err := a.ensureNetns(ctx, e)
		if err == nil {
			err = a.deleteRules(ctx, withNS.Netns)
		}
		if err != nil {
			a.metrics.failure("removal")
			log.Warn("cannot delete the pod's rules; it stays in the mesh and is retried", "reason", reason, "error", err)
			return fmt.Errorf("remove pod %s/%s from the mesh: delete rules: %w", e.Namespace, e.Name, err)
		}
	}
	if err := a.release(ctx, log, e.UID, reason, false); err != nil {
		return err
	}
	log.Info("pod removed from the mesh", "reason", reason)
	return nil
}

// forget drops a pod whose sandbox or object is gone. Rules are not touched:
// the namespace is going away with the pod.
func (a *Agent) forget(ctx context.Context, e registry.Entry, reason string) error {
	log := a.podLog(e.Namespace, e.Name, e.UID)
	if err := a.release(ctx, log, e.UID, reason, true); err != nil {
		return err
	}
	log.Info("pod forgotten", "reason", reason)
	return nil
}

// release tells every ztunnel to drop the pod and removes its probe entry;
// only when both succeeded does the pod leave the registry, so a failure is
// retried whole. From its first call the pod is Releasing: out of every later
// snapshot, and a sync finishes the release before anything else. gone says
// the pod object or sandbox is gone (nothing to annotate).
func (a *Agent) release(ctx context.Context, log *slog.Logger, uid, reason string, gone bool) error {
	e, err := a.update(uid, func(x *registry.Entry) {
		x.Phase = registry.Releasing
		x.Gone = x.Gone || gone
	})
	if err != nil {
		return err
	}
	var errs []error
	if err := a.zt.DelWorkload(ctx, uid); err != nil {
		errs = append(errs, fmt.Errorf("ztunnel del: %w", err))
	}
	if err := a.rules.RemoveProbeIPs(ctx, uid, e.IPs); err != nil {
		errs = append(errs, fmt.Errorf("remove probe IPs: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		a.metrics.failure("removal")
		log.Warn("releasing pod failed, will retry", "reason", reason, "error", err)
		return err
	}
	if _, err := a.update(uid, func(x *registry.Entry) { x.Phase = registry.Absent }); err != nil {
		return err
	}
	a.forgetNetns(uid)
	a.invalid.forget(uid)
	a.readds.drop(uid) // released: nothing to re-add
	a.metrics.removal(reason)
	return nil
}
