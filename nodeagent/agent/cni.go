package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/cniserver"
)

// HandleAdd implements cniserver.Handler: it decides about a new pod sandbox
// and, if the pod belongs in the mesh, captures it before its containers
// start. A pod whose rules cannot be programmed gets an error, so the runtime
// retries the sandbox and the pod never runs uncaptured.
func (a *Agent) HandleAdd(ctx context.Context, ev cniserver.PodEvent) (out cniserver.Outcome, err error) {
	defer func() {
		if err == nil {
			a.metrics.cniAdds.WithLabelValues(out.String()).Inc()
		} else {
			a.metrics.cniAdds.WithLabelValues("error").Inc()
		}
	}()
	start := time.Now()
	pod, err := a.lookupPod(ctx, ev)
	a.metrics.step("lookup", start)
	if err != nil {
		a.metrics.failure("pod_unknown")
		return cniserver.OutcomeUnknown, err
	}
	uid := string(pod.UID)
	log := a.podLog(pod.Namespace, pod.Name, uid)

	d, err := a.decide(ctx, pod)
	if err != nil {
		a.metrics.failure("api")
		return cniserver.OutcomeUnknown, fmt.Errorf("decide about pod %s/%s: %w", ev.Namespace, ev.Name, err)
	}
	if !d.InMesh {
		log.Debug("pod not in mesh", "reason", d.Reason)
		return cniserver.NotInMesh, nil
	}
	opts, err := iptables.PodOptionsFromAnnotations(a.cfg.Rules, pod.Annotations)
	if err != nil {
		a.metrics.failure("bad_annotation")
		return cniserver.OutcomeUnknown, status.Errorf(codes.InvalidArgument, "pod %s/%s: %v", ev.Namespace, ev.Name, err)
	}
	h, err := openNetns(ev.NetnsPath)
	if err != nil {
		a.metrics.failure("netns")
		return cniserver.OutcomeUnknown, status.Errorf(codes.InvalidArgument, "pod %s/%s: netns %q: %v", ev.Namespace, ev.Name, ev.NetnsPath, err)
	}
	ips := make([]netip.Addr, 0, len(ev.IPs))
	for _, p := range ev.IPs {
		ips = append(ips, p.Addr().Unmap())
	}
	if len(ips) == 0 {
		ips = podIPs(pod)
	}

	unlock := a.locks.lock(uid)
	defer unlock()
	log.Info("enrolling new pod", "reason", d.Reason, "netns", ev.NetnsPath, "ips", ips)
	_, err = a.enroll(ctx, log, pod, h, ips, opts)
	switch {
	case err == nil:
		return cniserver.Enrolled, nil
	case !errors.Is(err, errPending):
		return cniserver.OutcomeUnknown, err
	case a.cfg.FailPending:
		// Policy: a pod ztunnel has not taken over may not start. Undo,
		// rules first. ztunnel may hold the pod even so (an ack that timed
		// out, or the probe entry failing after the ack): tell it to drop
		// the pod too (a Del of an unknown uid is fine for ztunnel), so it
		// does not keep a torn-down sandbox's netns.
		e, _ := a.reg.Get(uid)
		cctx := context.WithoutCancel(ctx)
		if e.Netns != nil {
			if derr := withNetNS(e.Netns, func(n ns.NetNS) error { return a.rules.DeletePod(cctx, n) }); derr != nil {
				log.Warn("removing rules of rejected pending pod", "error", derr)
			}
		}
		if derr := a.zt.DelWorkload(cctx, uid); derr != nil {
			log.Warn("telling ztunnel to drop rejected pending pod", "error", derr)
		}
		if derr := a.rules.RemoveProbeIPs(cctx, uid, e.IPs); derr != nil {
			log.Warn("removing probe entry of rejected pending pod", "error", derr)
		}
		a.reg.Delete(uid)
		a.status.Set(pod.Namespace, pod.Name, uid, "")
		return cniserver.OutcomeUnknown, status.Errorf(codes.Unavailable, "pod %s/%s: %v (--fail-pending is set)", ev.Namespace, ev.Name, err)
	default:
		// Rules are in place: traffic is captured and held by the redirect
		// until ztunnel takes the pod, so the pod may start. Retry it.
		a.queue.AddRateLimited(uid)
		return cniserver.Pending, nil
	}
}

// uidsWithNetns returns those of uids whose registered netns is the one at
// path (same inode). A path that is gone matches none.
func (a *Agent) uidsWithNetns(uids []string, path string) []string {
	var want unix.Stat_t
	if path == "" || unix.Stat(path, &want) != nil {
		return nil
	}
	var out []string
	for _, uid := range uids {
		e, ok := a.reg.Get(uid)
		if !ok || e.Netns == nil {
			continue
		}
		var st unix.Stat_t
		if unix.Fstat(int(e.Netns.Fd()), &st) == nil && st.Ino == want.Ino && st.Dev == want.Dev {
			out = append(out, uid)
		}
	}
	return out
}

// lookupPod finds the pod of a CNI event: first in the informer cache (a new
// pod is usually there within milliseconds), then with direct GETs, until
// PodLookupTimeout. A pod the API does not know is a clear error.
func (a *Agent) lookupPod(ctx context.Context, ev cniserver.PodEvent) (*corev1.Pod, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.PodLookupTimeout)
	defer cancel()
	match := func(p *corev1.Pod) bool { return p != nil && (ev.UID == "" || string(p.UID) == ev.UID) }
	cacheUntil := time.Now().Add(a.cfg.CacheWait)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var (
		lastErr  error       // last GET failure other than NotFound
		notFound bool        // some GET answered NotFound
		seen     *corev1.Pod // a pod of that name with another uid
	)
	for {
		if p := a.podByName(ev.Namespace, ev.Name); match(p) {
			return p, nil
		} else if p != nil {
			seen = p
		}
		if time.Now().After(cacheUntil) {
			gctx, gcancel := context.WithTimeout(ctx, 2*time.Second)
			p, err := a.client.CoreV1().Pods(ev.Namespace).Get(gctx, ev.Name, metav1.GetOptions{})
			gcancel()
			switch {
			case err == nil && match(p):
				return p, nil
			case err == nil:
				seen = p
			case apierrors.IsNotFound(err):
				notFound = true
			case ctx.Err() == nil:
				lastErr = err // not just cut short by our own deadline
			}
		}
		select {
		case <-ctx.Done():
			switch {
			case seen != nil:
				return nil, status.Errorf(codes.NotFound, "pod %s/%s: the API has uid %s, the runtime says %s (waited %v)", ev.Namespace, ev.Name, seen.UID, ev.UID, a.cfg.PodLookupTimeout)
			case notFound || lastErr == nil:
				return nil, status.Errorf(codes.NotFound, "pod %s/%s (uid %q) not found in the Kubernetes API (waited %v)", ev.Namespace, ev.Name, ev.UID, a.cfg.PodLookupTimeout)
			}
			return nil, status.Errorf(codes.Unavailable, "pod %s/%s: not in the informer cache and the API is unreachable (waited %v): %v", ev.Namespace, ev.Name, a.cfg.PodLookupTimeout, lastErr)
		case <-tick.C:
		}
	}
}

// HandleDel implements cniserver.Handler: the sandbox is being torn down, so
// ztunnel is told to drop the pod and the registry forgets it. Rules die with
// the namespace. A pod we do not know is success.
func (a *Agent) HandleDel(ctx context.Context, ev cniserver.PodEvent) error {
	uids := a.reg.FindByName(ev.Namespace, ev.Name)
	switch {
	case ev.UID != "":
		uids = uids[:0]
		if _, ok := a.reg.Get(ev.UID); ok {
			uids = append(uids, ev.UID)
		}
	case len(uids) > 1:
		// No uid from the runtime and several pods of that name (a
		// StatefulSet pod recreated): only the one whose netns this is.
		uids = a.uidsWithNetns(uids, ev.NetnsPath)
		if len(uids) == 0 {
			a.log.Warn("CNI DEL without pod uid matches several pods and none by netns; left to the informer",
				"namespace", ev.Namespace, "name", ev.Name, "netns", ev.NetnsPath)
		}
	}
	var errs []error
	for _, uid := range uids {
		unlock := a.locks.lock(uid)
		if e, ok := a.reg.Get(uid); ok {
			if err := a.forget(ctx, e, "sandbox_deleted"); err != nil {
				errs = append(errs, err)
			}
		}
		unlock()
	}
	return errors.Join(errs...)
}
