package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// cniInput is what only a CNI ADD knows about a pod: the pod as looked up
// (maybe not in the informer cache yet), its netns, its IPs and the
// policy's decision, each had once by the CNI edge.
type cniInput struct {
	pod *corev1.Pod
	// netns is the namespace the ADD named, opened by the edge: the
	// enrollment takes it (takeNetns); the edge closes it otherwise.
	netns *podnetns.Handle
	ips   []netip.Addr
	// decision is the policy's about pod; decideErr says it could not
	// decide (an API error).
	decision  policy.Decision
	decideErr error
}

// takeNetns hands the ADD's netns over to its taker.
func (in *cniInput) takeNetns() *podnetns.Handle {
	h := in.netns
	in.netns = nil
	return h
}

// closeNetns closes the ADD's netns unless it was taken.
func (in *cniInput) closeNetns() {
	if in.netns != nil {
		in.netns.Close()
		in.netns = nil
	}
}

// podSync is what one sync learned, for publishing the pod's status.
type podSync struct {
	pod    *corev1.Pod // nil when the pod is gone
	inMesh bool
	// undecided: the policy could not decide about the pod (an API
	// error), so inMesh means nothing.
	undecided bool
	// removing: the sync tried to take the pod out of the mesh (an error
	// then means the removal failed).
	removing bool
	// uncapturable: the pod belongs in the mesh but its runtime handler's
	// traffic is not captured by the rules (refuseUncapturable): why.
	uncapturable error
}

// sync is the one per-pod path: it drives pod uid to where it belongs and
// publishes the status derived from its phase. The workqueue calls it with
// in == nil; CNI ADD with what only it knows, and gets the sync's outcome.
// It is idempotent; an error requeues the pod (workqueue) or fails the ADD.
// It runs under the pod's lock, like every change of the pod's phase.
//
// A CNI ADD waits for the lock only within its deadline (the plugin's, which
// gRPC carries here): one whose caller gave up fails without touching the
// pod, rather than enrolling later a sandbox the runtime already abandoned.
func (a *Agent) sync(ctx context.Context, uid string, in *cniInput) (Outcome, error) {
	wait := time.Now()
	unlock, err := a.locks.lockCtx(ctx, uid)
	traceOf(ctx).add("queue", time.Since(wait))
	if err != nil {
		a.metrics.failure("deadline")
		return OutcomeUnknown, err
	}
	defer unlock()
	var s podSync
	out, err := a.syncLocked(ctx, uid, in, &s)
	after, _ := a.reg.Get(uid)
	a.publish(s, after, a.takeMoved(uid), err)
	return out, err
}

// syncLocked is sync's body, under the pod's lock: the pod (podToSync),
// then by the policy's decision its release finished, its removal, or its
// capture (syncInMesh).
func (a *Agent) syncLocked(ctx context.Context, uid string, in *cniInput, s *podSync) (Outcome, error) {
	entry, registered := a.reg.Get(uid)
	readd := a.readds.take(uid)
	pod, err := a.podToSync(ctx, uid, in, entry, registered)
	if pod == nil {
		return OutcomeUnknown, err
	}
	s.pod = pod
	log := a.podLog(pod.Namespace, pod.Name, uid)
	if readd && !registered {
		a.readds.drop(uid) // not ours to re-add
	}

	if pod.Spec.HostNetwork {
		// The host is never a pod, whatever the pod's labels, annotations
		// or the policy's configuration say: nothing is looked up, Added
		// or cleaned in what is the node's own network namespace. A
		// hostNetwork pod registered anyhow is only released (ztunnel
		// told to drop it, its probe entry removed), its "rules" left
		// alone: they would be the node's.
		if registered {
			s.removing = true
			log.Warn("hostNetwork pod was registered; releasing it without touching any rules")
			return NotInMesh, a.release(ctx, log, uid, string(policy.ReasonHostNetwork), false)
		}
		return NotInMesh, nil
	}

	var d policy.Decision
	if in != nil {
		d, err = in.decision, in.decideErr // the CNI edge decided
	} else {
		d, err = a.decide(ctx, pod)
	}
	if err != nil {
		s.undecided = true
		a.metrics.failure("api")
		return OutcomeUnknown, fmt.Errorf("decide about pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	s.inMesh = d.InMesh
	if entry, registered, err = a.settle(ctx, log, s, uid, entry, registered, d.Reason); err != nil {
		return OutcomeUnknown, err
	}
	if !d.InMesh {
		return a.syncOutOfMesh(ctx, log, s, pod, entry, registered, d.Reason)
	}
	return a.syncInMesh(ctx, log, s, pod, in, entry, registered, readd, d.Reason)
}

// podToSync is the pod a sync drives: the one a CNI ADD looked up, else
// the cached one. A pod the cache no longer has is made sure of with the
// API before it is dropped (a CNI ADD may have enrolled a pod the cache has
// not seen yet). nil: nothing (more) to do, err saying how that went.
func (a *Agent) podToSync(ctx context.Context, uid string, in *cniInput, entry registry.Entry, registered bool) (*corev1.Pod, error) {
	if in != nil {
		return in.pod, nil
	}
	if pod := a.podByUID(uid); pod != nil {
		return pod, nil
	}
	if !registered {
		a.invalid.forget(uid)
		a.readds.drop(uid)
		return nil, nil
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	p, err := a.client.CoreV1().Pods(entry.Namespace).Get(cctx, entry.Name, metav1.GetOptions{})
	cancel()
	switch {
	case err == nil && string(p.UID) == uid:
		return p, nil
	case err == nil || apierrors.IsNotFound(err):
		return nil, a.forget(ctx, entry, "deleted")
	default:
		a.metrics.failure("api")
		return nil, fmt.Errorf("check pod %s/%s: %w: %w", entry.Namespace, entry.Name, ErrAPIUnavailable, err)
	}
}

// settle brings pod uid's entry up to date before the sync acts on it: a
// release that did not finish is finished first (the pod is then no
// longer registered), and a ztunnel's snapshot refusal (taken either way)
// makes an enabled pod Pending.
func (a *Agent) settle(ctx context.Context, log *slog.Logger, s *podSync, uid string, entry registry.Entry, registered bool, reason policy.Reason) (registry.Entry, bool, error) {
	if registered && entry.Phase == registry.Releasing {
		// A release that did not finish (its Del or probe step failed).
		// The pod's rules are gone (or the pod is), so finish it; a pod
		// that belongs in the mesh again is then enrolled afresh.
		s.removing = true
		if err := a.release(ctx, log, uid, string(reason), false); err != nil {
			return entry, registered, err
		}
		entry, registered, s.removing = registry.Entry{UID: uid}, false, false
	}
	if refused := a.takeRefusal(uid); refused && registered && (entry.Phase == registry.Enabled || entry.Phase == registry.Unserved) {
		// A (new) ztunnel refused the pod in its snapshot: it does not
		// carry it, whatever we believed. Pending (its rules and probe
		// entry stay: they are in place), and re-added by this sync.
		var err error
		if entry, err = a.update(uid, func(e *registry.Entry) {
			e.Phase, e.LastError, e.Reason = registry.Pending, "refused in a ztunnel snapshot", ReasonZtunnelRejected
		}); err != nil {
			return entry, registered, err
		}
	}
	return entry, registered, nil
}

// syncOutOfMesh is the sync of a pod the policy puts in no mesh: a
// registered one is removed; one the agent may have left rules in (the
// state file records it) has them deleted.
func (a *Agent) syncOutOfMesh(ctx context.Context, log *slog.Logger, s *podSync, pod *corev1.Pod, entry registry.Entry, registered bool, reason policy.Reason) (Outcome, error) {
	if registered {
		s.removing = true
		log.Info("pod left the mesh", "reason", reason)
		return NotInMesh, a.removeFromMesh(ctx, log, pod, entry, string(reason))
	}
	if a.state != nil && a.state.Has(string(pod.UID)) && a.isRunning(pod) {
		// Our rules may be in it: the agent stopped while enrolling or
		// removing it (a restart's cleanup that failed is retried here).
		return NotInMesh, a.cleanStale(ctx, pod)
	}
	log.Debug("pod not in mesh", "reason", reason)
	return NotInMesh, nil
}

// syncInMesh is the sync of a pod the policy puts in the mesh: refused
// under a runtime handler the rules do not capture; else enrolled from its
// CNI ADD, kept (enabled) or brought back (recapture) when registered, or
// found and enrolled when running.
func (a *Agent) syncInMesh(ctx context.Context, log *slog.Logger, s *podSync, pod *corev1.Pod, in *cniInput, entry registry.Entry, registered, readd bool, reason policy.Reason) (Outcome, error) {
	verdict, err := a.runtimeVerdict(ctx, pod)
	if err != nil {
		s.undecided = true
		a.metrics.failure("api")
		return OutcomeUnknown, err
	}
	if verdict != nil {
		return a.refuseUncapturable(ctx, log, s, pod, entry, registered, in != nil, verdict)
	}
	defaults := podopts.Defaults(a.cfg.DNSCapture)
	base := defaults
	if registered {
		base = entry.Options // what its rules were programmed with
	}
	opts, invalid := podopts.Options(defaults, base, pod.Annotations)
	a.noteInvalid(pod, registered, invalid)
	switch {
	case in != nil:
		return a.enrollNew(ctx, log, s, pod, in, opts, refuses(registered, invalid), reason)
	case registered && (entry.Phase == registry.Enabled || entry.Phase == registry.Unserved):
		return a.syncEnabled(ctx, log, s, pod, entry, opts, readd)
	case registered: // Unverified, Pending, Uncaptured
		return a.recapture(ctx, log, s, pod, entry, opts)
	}
	return a.enrollRunning(ctx, log, pod, opts, refuses(false, invalid), reason)
}

// enrollRunning enrolls a running pod that belongs in the mesh but was not
// enrolled through CNI (label added later, or enrolled before we knew): its
// netns is found by a /proc scan. refused: its annotations refuse it.
func (a *Agent) enrollRunning(ctx context.Context, log *slog.Logger, pod *corev1.Pod, opts iptables.PodOptions, refused error, reason policy.Reason) (Outcome, error) {
	ips := podmeta.IPs(pod)
	if len(ips) == 0 || pod.Status.Phase != corev1.PodRunning {
		return OutcomeUnknown, nil // not started yet; its CNI ADD or a later update brings it
	}
	if pod.DeletionTimestamp != nil {
		// Terminating and not held: its sandbox is going (the CNI DEL
		// may have come already); enrolling it would fail or outlive it.
		log.Debug("not enrolling a terminating pod")
		return OutcomeUnknown, nil
	}
	if refused != nil {
		log.Warn("cannot enroll pod", "error", refused)
		return OutcomeUnknown, nil // retrying cannot help; the next pod update will
	}
	uid := string(pod.UID)
	start := time.Now()
	h, err := a.finder.FindOne(ctx, podnetns.Target{UID: uid, RuntimeUID: a.runtimeUID(pod), IPs: ips})
	a.metrics.step(ctx, "netns", start)
	if err != nil {
		a.metrics.failure("netns_not_found")
		log.Warn("cannot find the pod's network namespace", "error", err)
		return OutcomeUnknown, fmt.Errorf("%w: %w", ErrNetnsUnusable, err)
	}
	log.Info("enrolling running pod", "reason", reason, "netns", h.Path())
	return a.enroll(ctx, log, pod, h, ips, opts)
}

// refuses returns the error a pod's enrollment is refused with: a pod not
// enrolled yet whose annotations have an invalid value the agent does not
// ignore (podopts.RefuseNew). An enrolled pod keeps its options instead.
func refuses(registered bool, invalid []*podopts.InvalidAnnotationError) error {
	if registered {
		return nil
	}
	for _, e := range invalid {
		if e.OnInvalid == podopts.RefuseNew {
			return e
		}
	}
	return nil
}
