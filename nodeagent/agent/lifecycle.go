package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// syncEnabled checks an enabled (or unserved) pod: its held netns must
// still be its current sandbox (see notCurrent), or it leaves that sandbox —
// pending, probe entry removed, published — and is enrolled again in its new
// one in this same sync. A pod a closed ztunnel held is handed over to the
// newest (a fresh Add under the pod's lock: the one writer of what ztunnel
// carries). While no ztunnel serves the node past the grace an enabled pod
// is Unserved (served.go); once one serves again an unserved pod is Added to
// it and Enabled.
func (a *Agent) syncEnabled(ctx context.Context, log *slog.Logger, s *podSync, pod *corev1.Pod, e registry.Entry, opts iptables.PodOptions, readd bool) (Outcome, error) {
	ips := podmeta.IPs(pod)
	if why := a.notCurrent(e, ips); why != "" {
		e, err := a.leaveSandbox(ctx, log, s, e, ips, why)
		if err != nil {
			return OutcomeUnknown, err
		}
		return a.recapture(ctx, log, s, pod, e, opts)
	}
	if len(e.LaggingAPIIPs) > 0 && len(ips) > 0 && subsetIPs(ips, e.IPs) {
		// The API caught up with the sandbox the ADD enrolled.
		var err error
		if e, err = a.update(e.UID, func(x *registry.Entry) { x.LaggingAPIIPs = nil }); err != nil {
			return OutcomeUnknown, err
		}
	}
	if len(e.IPs) == 0 && len(ips) > 0 {
		// The ADD carried no IPs; the API has them now (the netns holds
		// them: checked above). Not a new sandbox: fill them in.
		var err error
		if e, err = a.update(e.UID, func(x *registry.Entry) { x.IPs = ips }); err != nil {
			return OutcomeUnknown, err
		}
		if err := a.rules.AddProbeIPs(ctx, e.UID, ips); err != nil {
			a.metrics.failure("probe_ips")
			return OutcomeUnknown, fmt.Errorf("pod %s/%s: add probe IPs %v: %w", e.Namespace, e.Name, ips, err)
		}
	}
	switch {
	case a.ztunnelOutage():
		if e.Phase == registry.Enabled {
			if _, err := a.unserved(e.UID); err != nil {
				return OutcomeUnknown, err
			}
			log.Warn("pod not ready: no ztunnel serves the node", "grace", a.cfg.ZtunnelGrace)
		}
		return Pending, nil
	case e.Phase == registry.Unserved:
		log.Info("a ztunnel serves the node again; adding the pod to it")
		return a.activate(ctx, log, e)
	case readd:
		log.Info("re-adding the pod to the newest ztunnel")
		return a.activate(ctx, log, e)
	}
	return Enrolled, nil // the status, if off, is healed by publish
}

// recapture brings an unverified, pending or uncaptured pod (back) to
// enabled in its current sandbox: a held netns that is no longer the pod's
// is let go (see notCurrent), a missing one is found; its rules are read
// back and repaired where they differ, its probe entry put in (Pending);
// then ztunnel is told. The pod stays registered throughout, so a ztunnel
// that may serve it is never told to drop it.
func (a *Agent) recapture(ctx context.Context, log *slog.Logger, s *podSync, pod *corev1.Pod, e registry.Entry, opts iptables.PodOptions) (Outcome, error) {
	ips := podmeta.IPs(pod)
	if e.Netns != nil {
		if why := a.notCurrent(e, ips); why != "" {
			var err error
			if e, err = a.leaveSandbox(ctx, log, s, e, ips, why); err != nil {
				return OutcomeUnknown, err
			}
		}
	}
	if len(ips) > 0 && !subsetIPs(ips, e.IPs) {
		var err error
		if e, err = a.update(e.UID, func(x *registry.Entry) { x.IPs = ips }); err != nil {
			return OutcomeUnknown, err
		}
	}
	e, err := a.ensureNetns(ctx, e)
	if err != nil {
		return OutcomeUnknown, err
	}
	if e, err = a.capture(ctx, log, e, opts); err != nil {
		if errors.Is(err, ErrPending) {
			return Pending, err
		}
		a.unrepaired(log, e.UID, err)
		return OutcomeUnknown, err
	}
	return a.activate(ctx, log, e)
}

// enrollNew is the CNI ADD part of sync for a pod in the mesh: it enrolls
// the pod in the runtime's netns, taking the handle the ADD opened. With
// FailPending, a pod ztunnel did not take is released again through the
// same path as a removal.
func (a *Agent) enrollNew(ctx context.Context, log *slog.Logger, s *podSync, pod *corev1.Pod, in *cniInput, opts iptables.PodOptions, refused error, reason policy.Reason) (Outcome, error) {
	uid := string(pod.UID)
	if refused != nil {
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w: %w", pod.Namespace, pod.Name, ErrInvalidPod, refused)
	}
	if err := ctx.Err(); err != nil {
		// The plugin gave up while this ADD waited: enrolling now would
		// act on a sandbox the runtime abandoned.
		a.metrics.failure("deadline")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: CNI ADD abandoned by its caller: %w", pod.Namespace, pod.Name, err)
	}
	h := in.takeNetns()
	ips := in.ips
	if len(ips) == 0 {
		ips = podmeta.IPs(pod)
	}
	log.Info("enrolling new pod", "reason", reason, "netns", h.Path(), "ips", ips)
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
// h), registers it with its probe entry, and activates it with ztunnel.
// Rule failure: nothing is left behind (a pod enrolled before in another
// sandbox keeps its registration, uncaptured) and an error wrapping
// ErrNotCaptured is returned. ztunnel failure: the pod stays registered as
// pending and an error wrapping ErrPending is returned.
func (a *Agent) enroll(ctx context.Context, log *slog.Logger, pod *corev1.Pod, h *podnetns.Handle, ips []netip.Addr, opts iptables.PodOptions) (Outcome, error) {
	if err := a.checkFamilies(pod, ips); err != nil {
		h.Close()
		return OutcomeUnknown, err
	}
	uid := string(pod.UID)
	prev, registered := a.reg.Get(uid)
	sa := pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	e := registry.Entry{UID: uid, Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: sa, IPs: ips, Netns: h, Phase: registry.Pending, Options: opts}
	if api := podmeta.IPs(pod); len(api) > 0 && !subsetIPs(api, ips) {
		// The API still shows the sandbox before this one (see
		// registry.Entry.LaggingAPIIPs).
		e.LaggingAPIIPs = api
	}
	if err := a.writeRules(ctx, h, opts); err != nil {
		a.metrics.failure("rules")
		// Apply is atomic per family, but one family may have landed.
		if derr := a.deleteRules(context.WithoutCancel(ctx), h); derr != nil {
			log.Warn("cleanup after failed rule apply", "error", derr)
		}
		h.Close()
		return OutcomeUnknown, fmt.Errorf("%w: program in-pod rules for %s/%s: %w", ErrNotCaptured, pod.Namespace, pod.Name, err)
	}
	if registered && len(prev.IPs) > 0 && !sameIPs(prev.IPs, ips) {
		// A new sandbox of an enrolled pod: its old addresses may be
		// another pod's soon.
		if err := a.rules.RemoveProbeIPs(ctx, uid, prev.IPs); err != nil {
			log.Warn("removing the old sandbox's probe entry; the drift pass prunes it", "ips", prev.IPs, "error", err)
		}
	}
	e, err := a.update(uid, func(x *registry.Entry) {
		phase := x.Phase
		*x = e
		if phase == registry.Enabled {
			x.Phase = registry.Enabled // an enabled pod stays so unless the re-add fails
		}
	})
	if err != nil {
		return OutcomeUnknown, err
	}
	a.recordNetns(e.UID, h, opts)
	if e, err = a.addProbe(ctx, log, e); err != nil {
		return Pending, err
	}
	return a.activate(ctx, log, e)
}

// capture makes e's held netns (the pod's current sandbox) carry our rules
// with opts: read back and repaired only where they differ, so an intact pod
// sees no write. Then the pod's probe entry goes in and the pod is Pending
// (an enabled one stays Enabled). An error wrapping ErrNotCaptured means the
// rules are not known to be in place (the caller makes the pod Uncaptured);
// one wrapping ErrPending that the probe entry failed.
func (a *Agent) capture(ctx context.Context, log *slog.Logger, e registry.Entry, opts iptables.PodOptions) (registry.Entry, error) {
	if _, err := a.checkRules(ctx, log, e, opts); err != nil {
		return e, err
	}
	e, err := a.update(e.UID, func(x *registry.Entry) {
		x.Options = opts
		if x.Phase != registry.Enabled {
			x.Phase = registry.Pending
		}
	})
	if err != nil {
		return e, err
	}
	return a.addProbe(ctx, log, e)
}

// addProbe puts the pod's IPs in the node's probe set: a pod whose rules
// are in place has its kubelet probes SNATed past the capture (the one
// probe rule, registry.ProbeEntry). A failure leaves the pod Pending with
// the reason, and an error wrapping ErrPending.
func (a *Agent) addProbe(ctx context.Context, log *slog.Logger, e registry.Entry) (registry.Entry, error) {
	start := time.Now()
	err := a.rules.AddProbeIPs(ctx, e.UID, e.IPs)
	a.metrics.step(ctx, "probe_ips", start)
	if err == nil {
		return e, nil
	}
	a.metrics.failure("probe_ips")
	e, uerr := a.update(e.UID, func(x *registry.Entry) {
		x.Phase, x.LastError, x.Reason = registry.Pending, fmt.Sprintf("add probe IPs %v: %v", x.IPs, err), ReasonRulesFailed
	})
	if uerr != nil {
		return e, uerr
	}
	log.Warn("pod pending: its probe entry failed", "error", err)
	return e, fmt.Errorf("%w: pod %s/%s: add probe IPs: %w", ErrPending, e.Namespace, e.Name, err)
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

// activate tells ztunnel about a pod whose rules and probe entry are in
// place and, once acked, moves it to Enabled. On failure the pod is Pending
// (its rules and probe entry stay) and an error wrapping ErrPending is
// returned.
func (a *Agent) activate(ctx context.Context, log *slog.Logger, e registry.Entry) (Outcome, error) {
	done := a.readds.done(e.UID)
	setPending := func(reason string, err error) (Outcome, error) {
		a.metrics.failure(reason)
		if _, uerr := a.update(e.UID, func(x *registry.Entry) {
			if x.Phase == registry.Unserved && reason == "no_ztunnel" {
				return // the ztunnel that served again is gone again: still unserved
			}
			x.Phase, x.LastError, x.Reason = registry.Pending, err.Error(), pendingReason(reason)
		}); uerr != nil {
			return OutcomeUnknown, uerr
		}
		log.Warn("pod pending", "reason", reason, "error", err)
		return Pending, fmt.Errorf("%w: %w", ErrPending, err)
	}
	if e.Netns == nil || a.finder.IsHost(e.Netns) {
		err := fmt.Errorf("pod %s/%s: no network namespace of its own to hand to ztunnel", e.Namespace, e.Name)
		done(err)
		return setPending("ztunnel", err)
	}
	start := time.Now()
	err := a.zt.AddWorkload(ctx, ztunnel.Workload{UID: e.UID, Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount}, e.Netns)
	a.metrics.step(ctx, "ztunnel_ack", start)
	done(err)
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
	if _, err := a.update(e.UID, func(x *registry.Entry) { x.Phase, x.LastError, x.Reason = registry.Enabled, "", "" }); err != nil {
		return OutcomeUnknown, err
	}
	if ack := a.lastAck.Load(); ack != 0 && (e.Phase == registry.Pending || e.Phase == registry.Unserved) {
		a.metrics.ackToEnabled.Observe(time.Since(time.Unix(0, ack)).Seconds())
	}
	log.Info("pod enrolled", "ips", e.IPs, "netns", e.Netns.String())
	return Enrolled, nil
}
