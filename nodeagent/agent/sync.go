package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podmeta"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/policy"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// cniInput is what only a CNI ADD knows about a pod: the pod as looked up
// (maybe not in the informer cache yet), its netns path and its IPs.
type cniInput struct {
	pod       *corev1.Pod
	netnsPath string
	ips       []netip.Addr
}

// podSync is what one sync learned, for publishing the pod's status.
type podSync struct {
	pod    *corev1.Pod // nil when the pod is gone
	inMesh bool
	// removing: the sync tried to take the pod out of the mesh (an error
	// then means the removal failed).
	removing bool
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
	unlock, err := a.locks.lockCtx(ctx, uid)
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

func (a *Agent) syncLocked(ctx context.Context, uid string, in *cniInput, s *podSync) (Outcome, error) {
	entry, registered := a.reg.Get(uid)
	var pod *corev1.Pod
	if in != nil {
		pod = in.pod
	} else if pod = a.podByUID(uid); pod == nil {
		if !registered {
			return OutcomeUnknown, nil
		}
		// The cache says the pod is gone; make sure before dropping it
		// (a CNI ADD may have enrolled a pod the cache has not seen yet).
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		p, err := a.client.CoreV1().Pods(entry.Namespace).Get(cctx, entry.Name, metav1.GetOptions{})
		cancel()
		switch {
		case err == nil && string(p.UID) == uid:
			pod = p
		case err == nil || apierrors.IsNotFound(err):
			return OutcomeUnknown, a.forget(ctx, entry, "deleted")
		default:
			a.metrics.failure("api")
			return OutcomeUnknown, fmt.Errorf("check pod %s/%s: %w: %w", entry.Namespace, entry.Name, ErrAPIUnavailable, err)
		}
	}
	s.pod = pod
	log := a.podLog(pod.Namespace, pod.Name, uid)

	d, err := a.decide(ctx, pod)
	if err != nil {
		a.metrics.failure("api")
		return OutcomeUnknown, fmt.Errorf("decide about pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	s.inMesh = d.InMesh
	if registered && entry.Phase == registry.Releasing {
		// A release that did not finish (its Del or probe step failed).
		// The pod's rules are gone (or the pod is), so finish it; a pod
		// that belongs in the mesh again is then enrolled afresh below.
		s.removing = true
		if err := a.release(ctx, log, uid, string(d.Reason), false); err != nil {
			return OutcomeUnknown, err
		}
		entry, registered, s.removing = registry.Entry{UID: uid}, false, false
	}
	if refused := a.takeRefusal(uid); refused && registered && entry.Phase == registry.Enabled {
		// A (new) ztunnel refused the pod in its snapshot: it does not
		// carry it, whatever we believed. Pending, and re-added below.
		if entry, err = a.update(uid, func(e *registry.Entry) {
			e.Phase, e.LastError, e.Reason = registry.Pending, "refused in a ztunnel snapshot", ReasonZtunnelRejected
		}); err != nil {
			return OutcomeUnknown, err
		}
	}
	if !d.InMesh {
		if registered {
			s.removing = true
			log.Info("pod left the mesh", "reason", d.Reason)
			return NotInMesh, a.removeFromMesh(ctx, log, pod, entry, string(d.Reason))
		}
		log.Debug("pod not in mesh", "reason", d.Reason)
		return NotInMesh, nil
	}

	opts, optsErr := podmeta.PodOptions(a.cfg.DNSCapture, pod.Annotations)
	if in != nil {
		return a.enrollNew(ctx, log, pod, in, opts, optsErr, d.Reason)
	}
	if registered {
		switch entry.Phase {
		case registry.Unverified:
			return a.verifyRestored(ctx, log, entry, opts, optsErr)
		case registry.Enabled:
			if ips := podIPs(pod); len(ips) > 0 && !sameIPs(ips, entry.IPs) {
				return a.changeIPs(ctx, log, entry, ips)
			}
			return Enrolled, nil // the status, if off, is healed by publish
		default:
			return a.retryPending(ctx, log, entry, opts, optsErr)
		}
	}

	// A running pod that belongs in the mesh but was not enrolled through
	// CNI (label added later, or enrolled before we knew): find its netns.
	ips := podIPs(pod)
	if len(ips) == 0 || pod.Status.Phase != corev1.PodRunning {
		return OutcomeUnknown, nil // not started yet; its CNI ADD or a later update brings it
	}
	if optsErr != nil {
		a.metrics.failure("bad_annotation")
		log.Warn("cannot enroll pod", "error", optsErr)
		return OutcomeUnknown, nil // retrying cannot help; the next pod update will
	}
	start := time.Now()
	h, err := a.finder.FindOne(ctx, podnetns.Target{UID: uid, IPs: ips})
	a.metrics.step("netns", start)
	if err != nil {
		a.metrics.failure("netns_not_found")
		log.Warn("cannot find the pod's network namespace", "error", err)
		return OutcomeUnknown, fmt.Errorf("%w: %w", ErrNetnsUnusable, err)
	}
	log.Info("enrolling running pod", "reason", d.Reason, "netns", h.Path())
	return a.enroll(ctx, log, pod, h, ips, opts)
}

// enrollNew is the CNI ADD part of sync for a pod in the mesh: it opens the
// runtime's netns and enrolls the pod there. With FailPending, a pod ztunnel
// did not take is released again through the same path as a removal.
func (a *Agent) enrollNew(ctx context.Context, log *slog.Logger, pod *corev1.Pod, in *cniInput, opts iptables.PodOptions, optsErr error, reason policy.Reason) (Outcome, error) {
	uid := string(pod.UID)
	if optsErr != nil {
		a.metrics.failure("bad_annotation")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w: %w", pod.Namespace, pod.Name, ErrInvalidPod, optsErr)
	}
	if err := ctx.Err(); err != nil {
		// The plugin gave up while this ADD waited: enrolling now would
		// act on a sandbox the runtime abandoned.
		a.metrics.failure("deadline")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: CNI ADD abandoned by its caller: %w", pod.Namespace, pod.Name, err)
	}
	start := time.Now()
	h, err := podnetns.Open(in.netnsPath)
	a.metrics.step("netns", start)
	if err != nil {
		a.metrics.failure("netns")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w: netns %q: %w", pod.Namespace, pod.Name, ErrNetnsUnusable, in.netnsPath, err)
	}
	ips := in.ips
	if len(ips) == 0 {
		ips = podIPs(pod)
	}
	log.Info("enrolling new pod", "reason", reason, "netns", in.netnsPath, "ips", ips)
	out, err := a.enroll(ctx, log, pod, h, ips, opts)
	switch {
	case err == nil || !errors.Is(err, ErrPending):
		return out, err
	case a.cfg.FailPending:
		// Policy: a pod ztunnel has not taken over may not start. Undo it
		// like a removal, rules first; ztunnel may hold the pod even so (an
		// ack that timed out), so it is told to drop it too. A release that
		// cannot finish stays Releasing and is retried.
		cctx := context.WithoutCancel(ctx)
		e, _ := a.reg.Get(uid)
		if rerr := a.removeFromMesh(cctx, log, pod, e, "fail_pending"); rerr != nil {
			a.metrics.retries.WithLabelValues("removal").Inc()
			a.queue.AddRateLimited(uid)
		}
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w (--fail-pending is set)", pod.Namespace, pod.Name, err)
	default:
		// Rules are in place: traffic is captured and held by the redirect
		// until ztunnel takes the pod, so the pod may start. Retry it.
		a.metrics.retries.WithLabelValues("pending").Inc()
		a.queue.AddRateLimited(uid)
		return Pending, nil
	}
}

// enroll programs the pod's rules in the netns open as h (taking ownership of
// h), registers it, and activates it with ztunnel. Rule failure: nothing is
// left behind and an error wrapping ErrNotCaptured is returned. ztunnel
// failure: the pod stays registered as pending and an error wrapping
// ErrPending is returned.
func (a *Agent) enroll(ctx context.Context, log *slog.Logger, pod *corev1.Pod, h *podnetns.Handle, ips []netip.Addr, opts iptables.PodOptions) (Outcome, error) {
	if err := a.checkFamilies(pod, ips); err != nil {
		h.Close()
		return OutcomeUnknown, err
	}
	if err := a.writeRules(ctx, h, opts); err != nil {
		a.metrics.failure("rules")
		// Apply is atomic per family, but one family may have landed.
		if derr := a.rules.DeletePod(context.WithoutCancel(ctx), h); derr != nil {
			log.Warn("cleanup after failed rule apply", "error", derr)
		}
		h.Close()
		return OutcomeUnknown, fmt.Errorf("%w: program in-pod rules for %s/%s: %w", ErrNotCaptured, pod.Namespace, pod.Name, err)
	}
	sa := pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	e, err := a.update(string(pod.UID), func(e *registry.Entry) {
		e.Name, e.Namespace, e.ServiceAccount = pod.Name, pod.Namespace, sa
		e.IPs, e.Netns = ips, h
		if e.Phase != registry.Enabled {
			e.Phase = registry.Pending // an enabled pod stays so unless the re-add fails
		}
	})
	if err != nil {
		return OutcomeUnknown, err
	}
	a.recordNetns(e.UID, h)
	return a.activate(ctx, log, e)
}

// changeIPs follows an enabled pod's IPs as the API now shows them (e.g. the
// ADD carried none, or a family was added): the probe set drops the old
// addresses, so a reused IP never keeps probe SNAT, and gets the new ones.
func (a *Agent) changeIPs(ctx context.Context, log *slog.Logger, e registry.Entry, ips []netip.Addr) (Outcome, error) {
	if err := a.rules.RemoveProbeIPs(ctx, e.UID, e.IPs); err != nil {
		a.metrics.failure("probe_ips")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: remove old probe IPs: %w", e.Namespace, e.Name, err)
	}
	e, err := a.update(e.UID, func(x *registry.Entry) { x.IPs = ips })
	if err != nil {
		return OutcomeUnknown, err
	}
	if err := a.rules.AddProbeIPs(ctx, e.UID, ips); err != nil {
		a.metrics.failure("probe_ips")
		a.unrepaired(log, e.UID, fmt.Errorf("add probe IPs %v: %w", ips, err))
		return Pending, nil
	}
	a.metrics.repairs.WithLabelValues("probe_set").Inc()
	log.Info("pod IPs changed; probe set follows", "ips", ips)
	return Enrolled, nil
}

// sameIPs compares two address lists as sets.
func sameIPs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	x, y := slices.Clone(a), slices.Clone(b)
	slices.SortFunc(x, func(p, q netip.Addr) int { return p.Compare(q) })
	slices.SortFunc(y, func(p, q netip.Addr) int { return p.Compare(q) })
	return slices.Equal(x, y)
}

// checkFamilies refuses a pod with an IPv6 address when IPv6 capture is
// off: its IPv6 traffic would bypass ztunnel while the pod shows enabled.
// Failing closed is the only honest outcome (the CNI ADD fails, so the pod
// does not start uncaptured); run with --ipv6 (the default) instead.
func (a *Agent) checkFamilies(pod *corev1.Pod, ips []netip.Addr) error {
	if a.cfg.IPv6 {
		return nil
	}
	for _, ip := range ips {
		if ip.Is6() && !ip.Is4In6() {
			a.metrics.failure("rules")
			return fmt.Errorf("%w: pod %s/%s has IPv6 address %s but IPv6 capture is off (--ipv6=false): its IPv6 traffic would bypass ztunnel",
				ErrNotCaptured, pod.Namespace, pod.Name, ip)
		}
	}
	return nil
}

// activate tells ztunnel about a registered pod and, once acked, adds its
// probe IPs and moves it to Enabled. On failure the pod is Pending and an
// error wrapping ErrPending is returned.
func (a *Agent) activate(ctx context.Context, log *slog.Logger, e registry.Entry) (Outcome, error) {
	setPending := func(reason string, err error) (Outcome, error) {
		a.metrics.failure(reason)
		if _, uerr := a.update(e.UID, func(x *registry.Entry) {
			x.Phase, x.LastError, x.Reason = registry.Pending, err.Error(), pendingReason(reason)
		}); uerr != nil {
			return OutcomeUnknown, uerr
		}
		log.Warn("pod pending", "reason", reason, "error", err)
		return Pending, fmt.Errorf("%w: %w", ErrPending, err)
	}
	start := time.Now()
	err := a.zt.AddWorkload(ctx, ztunnel.Workload{UID: e.UID, Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount}, e.Netns)
	a.metrics.step("ztunnel_ack", start)
	if err != nil {
		reason := "ztunnel"
		var nack *ztunnel.NackError
		switch {
		case errors.Is(err, ztunnel.ErrNoZtunnel):
			reason = "no_ztunnel"
		case errors.As(err, &nack):
			reason = "ztunnel_nack"
		}
		return setPending(reason, err)
	}
	start = time.Now()
	err = a.rules.AddProbeIPs(ctx, e.UID, e.IPs)
	a.metrics.step("probe_ips", start)
	if err != nil {
		return setPending("probe_ips", err)
	}
	if _, err := a.update(e.UID, func(x *registry.Entry) { x.Phase, x.LastError, x.Reason = registry.Enabled, "", "" }); err != nil {
		return OutcomeUnknown, err
	}
	if ack := a.lastAck.Load(); ack != 0 && e.Phase == registry.Pending {
		a.metrics.ackToEnabled.Observe(time.Since(time.Unix(0, ack)).Seconds())
	}
	log.Info("pod enrolled", "ips", e.IPs)
	return Enrolled, nil
}

// verifyRestored finishes a pod that rebuild restored as Unverified: its
// rules are read back and repaired only where they differ, then it is
// activated like a new enrollment. The pod stays registered throughout, so
// ztunnel, which may already serve it, is never told to drop it.
func (a *Agent) verifyRestored(ctx context.Context, log *slog.Logger, e registry.Entry, opts iptables.PodOptions, optsErr error) (Outcome, error) {
	if optsErr != nil {
		a.metrics.failure("bad_annotation")
		log.Warn("cannot verify the rules of a restored pod", "error", optsErr)
		return OutcomeUnknown, nil // retrying cannot help; the next pod update will
	}
	e, err := a.ensureNetns(ctx, e) // rebuild restores these only with a netns; be safe
	if err != nil {
		return OutcomeUnknown, err
	}
	if _, err := a.checkRules(ctx, log, e, opts); err != nil {
		return OutcomeUnknown, err
	}
	if e, err = a.update(e.UID, func(x *registry.Entry) { x.Phase = registry.Pending }); err != nil {
		return OutcomeUnknown, err
	}
	log.Info("rules of restored unannotated pod verified")
	return a.activate(ctx, log, e)
}

// retryPending re-activates a pending pod: its netns is found first if a
// restart left it without one, and its rules are read back and repaired
// where they differ (a pod goes pending when a repair failed, and a pod
// whose netns was not found may have lost its rules meanwhile).
func (a *Agent) retryPending(ctx context.Context, log *slog.Logger, e registry.Entry, opts iptables.PodOptions, optsErr error) (Outcome, error) {
	if optsErr != nil {
		a.metrics.failure("bad_annotation")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w: %w", e.Namespace, e.Name, ErrInvalidPod, optsErr)
	}
	e, err := a.ensureNetns(ctx, e)
	if err != nil {
		return OutcomeUnknown, err
	}
	if _, err := a.checkRules(ctx, log, e, opts); err != nil {
		return OutcomeUnknown, err
	}
	return a.activate(ctx, log, e)
}

// ensureNetns returns e with a netns handle, finding it with a /proc scan
// when a restart left the pod without one.
func (a *Agent) ensureNetns(ctx context.Context, e registry.Entry) (registry.Entry, error) {
	if e.Netns != nil {
		return e, nil
	}
	found, err := a.findNetns(ctx, []podnetns.Target{{UID: e.UID, IPs: e.IPs}})
	h := found[e.UID]
	if err == nil && h == nil {
		err = fmt.Errorf("pod %s/%s (IPs %v): %w", e.Namespace, e.Name, e.IPs, podnetns.ErrNotFound)
	}
	if err != nil {
		a.metrics.failure("netns_not_found")
		return e, fmt.Errorf("%w: %w", ErrNetnsUnusable, err)
	}
	a.recordNetns(e.UID, h)
	return a.update(e.UID, func(x *registry.Entry) { x.Netns = h })
}

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
		withNS, err := a.ensureNetns(ctx, e)
		if err == nil {
			err = a.rules.DeletePod(ctx, withNS.Netns)
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
	a.metrics.removal(reason)
	return nil
}

// HandleAdd is the CNI ADD: it looks the pod up and runs the pod's sync with
// what only the runtime knows, so a new pod is captured before its
// containers start. A pod whose rules cannot be programmed gets an error, so
// the runtime retries the sandbox and the pod never runs uncaptured.
func (a *Agent) HandleAdd(ctx context.Context, ev PodEvent) (out Outcome, err error) {
	start := time.Now()
	defer func() {
		l := outcomeLabel(out, err)
		a.metrics.cniAdds.WithLabelValues(l).Inc()
		a.metrics.cniAddTime.WithLabelValues(l).Observe(time.Since(start).Seconds())
	}()
	pod, err := a.lookupPod(ctx, ev)
	a.metrics.step("lookup", start)
	if err != nil {
		a.metrics.failure("pod_unknown")
		return OutcomeUnknown, err
	}
	// The bounded pool: wait for a slot within the caller's deadline.
	select {
	case a.adds <- struct{}{}:
		defer func() { <-a.adds }()
	case <-ctx.Done():
		a.metrics.failure("deadline")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: waiting for one of %d enrollment slots: %w", pod.Namespace, pod.Name, cap(a.adds), ctx.Err())
	}
	ips := make([]netip.Addr, 0, len(ev.IPs))
	for _, p := range ev.IPs {
		ips = append(ips, p.Addr().Unmap())
	}
	if out, err, ok := a.addSidecar(ctx, pod, ev.NetnsPath, ips); ok {
		return out, err
	}
	return a.sync(ctx, string(pod.UID), &cniInput{pod: pod, netnsPath: ev.NetnsPath, ips: ips})
}

// HandleDel is the CNI DEL: the sandbox is being torn down, so ztunnel is
// told to drop the pod and the registry forgets it. Rules die with the
// namespace. A pod we do not know is success.
func (a *Agent) HandleDel(ctx context.Context, ev PodEvent) error {
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
		unlock, err := a.locks.lockCtx(ctx, uid)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if e, ok := a.reg.Get(uid); ok && a.otherNetns(e, ev.NetnsPath) {
			// A late DEL of an earlier sandbox of this pod (the runtime
			// recreated it): the live one must not lose its enrollment.
			a.podLog(e.Namespace, e.Name, uid).Info("CNI DEL names another network namespace than the pod's; ignored",
				"del_netns", ev.NetnsPath, "pod_netns", e.Netns.Path())
		} else if ok {
			if err := a.forget(ctx, e, "sandbox_deleted"); err != nil {
				errs = append(errs, err)
			}
		}
		a.takeMoved(uid) // gone: nothing to publish
		unlock()
	}
	return errors.Join(errs...)
}

// otherNetns reports whether a DEL naming path is about another sandbox
// than e's: path still exists and is not the namespace e holds; or path is
// empty while e's namespace is still where it was opened. containerd 1.6
// repeats DEL with an empty CNI_NETNS when kubelet removes a dead sandbox,
// which for a recreated pod comes while the new sandbox runs (seen on a real
// node: the live pod was dropped from ztunnel, then re-added by the
// informer). A DEL whose namespace is gone cannot tell, and counts.
func (a *Agent) otherNetns(e registry.Entry, path string) bool {
	if e.Netns == nil {
		return false
	}
	if path == "" {
		return e.Netns.SameAs(e.Netns.Path())
	}
	if _, err := os.Stat(path); err != nil {
		return false
	}
	return !e.Netns.SameAs(path)
}

// uidsWithNetns returns those of uids whose registered netns is the one at
// path. A path that is gone matches none.
func (a *Agent) uidsWithNetns(uids []string, path string) []string {
	var out []string
	for _, uid := range uids {
		if e, ok := a.reg.Get(uid); ok && e.Netns != nil && e.Netns.SameAs(path) {
			out = append(out, uid)
		}
	}
	return out
}
