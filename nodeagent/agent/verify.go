package agent

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"sync"
	"time"

	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// unrepaired takes a pod whose rules could not be verified or repaired out
// of Enabled or Pending, in one step with its probe entry (kubelet's probes
// must not be SNATed into a pod whose capture is not known): it is
// Uncaptured with the reason, published, and retried with backoff. The
// caller holds the pod's lock.
func (a *Agent) unrepaired(log *slog.Logger, uid string, err error) {
	e, ok := a.reg.Get(uid)
	if !ok || e.Phase == registry.Releasing || e.Phase == registry.Absent {
		return
	}
	if registry.ProbeEntry(e.Phase) && len(e.IPs) > 0 {
		if perr := a.rules.RemoveProbeIPs(context.Background(), uid, e.IPs); perr != nil {
			log.Warn("removing the probe entry of a pod whose rules cannot be repaired; the drift pass prunes it", "error", perr)
		}
	}
	if _, uerr := a.update(uid, func(x *registry.Entry) {
		x.Phase, x.LastError = registry.Uncaptured, err.Error()
		if x.Reason != ReasonSandboxChanged {
			x.Reason = ReasonRulesFailed
		}
	}); uerr != nil {
		log.Warn("marking unrepaired pod uncaptured", "error", uerr)
	}
	log.Warn("pod rules cannot be repaired; pod not captured, retried", "error", err)
	a.publishMoved(uid)
	a.queue.AddRateLimited(uid)
}

// verifyPod checks one registered pod under its lock: its held netns must
// still be its current sandbox (else it leaves it, and its sync enrolls it
// in the new one), then its rules are read back and repaired, with the
// options the pod's annotations give now, or, where those are invalid, the
// ones it was enrolled with. A pod whose rules cannot be repaired is
// Uncaptured.
func (a *Agent) verifyPod(ctx context.Context, uid string) {
	unlock := a.locks.lock(uid)
	defer unlock()
	e, ok := a.reg.Get(uid)
	if !ok || e.Netns == nil || e.Phase == registry.Releasing || e.Phase == registry.Uncaptured {
		return
	}
	log := a.podLog(e.Namespace, e.Name, uid)
	pod := a.podByUID(uid)
	if pod == nil {
		return // its sync forgets it
	}
	if why := a.notCurrent(e, podmeta.IPs(pod)); why != "" {
		s := podSync{pod: pod, inMesh: true}
		if _, err := a.leaveSandbox(ctx, log, &s, e, podmeta.IPs(pod), why); err == nil {
			a.queue.Add(uid)
		}
		return
	}
	d := podopts.Defaults(a.cfg.DNSCapture)
	opts, _ := podopts.Options(d, e.Options, pod.Annotations)
	if _, err := a.checkRules(ctx, log, e, opts); err != nil {
		if ctx.Err() == nil {
			a.unrepaired(log, uid, err)
		}
		return
	}
	if opts != e.Options {
		if _, err := a.update(uid, func(x *registry.Entry) { x.Options = opts }); err == nil {
			a.recordNetns(uid, e.Netns, opts)
		}
	}
}

// verifyAll verifies the given pods with up to Workers at a time.
func (a *Agent) verifyAll(ctx context.Context, uids []string) {
	work := make(chan string)
	var wg sync.WaitGroup
	for range min(a.cfg.Workers, max(len(uids), 1)) {
		wg.Go(func() {
			for uid := range work {
				a.verifyPod(ctx, uid)
			}
		})
	}
	for _, uid := range uids {
		work <- uid
	}
	close(work)
	wg.Wait()
}

// RunDrift runs the drift pass every VerifyInterval (jittered ±10%, so
// the nodes of a cluster do not verify in step) until ctx ends. With a zero
// interval it only waits for ctx.
func (a *Agent) RunDrift(ctx context.Context) error {
	if a.cfg.VerifyInterval <= 0 {
		<-ctx.Done()
		return nil
	}
	for {
		d := time.Duration(float64(a.cfg.VerifyInterval) * (0.9 + 0.2*rand.Float64()))
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		a.VerifyPass(ctx)
	}
}

// VerifyPass is one drift pass: the host rules are re-asserted, every
// enrolled pod's sandbox checked to be its current one and its rules read
// back and repaired where they differ, and the probe set made equal to the
// pods whose rules are in place. Drift is counted in
// ambientd_repairs_total{what}; a pod that cannot be repaired is Uncaptured
// and retried, so it is never left enabled while uncaptured.
func (a *Agent) VerifyPass(ctx context.Context) {
	start := time.Now()
	defer func() { a.metrics.verifyPass.Observe(time.Since(start).Seconds()) }()
	a.repairHost(ctx)
	a.verifyEnrolled(ctx)
	a.pruneProbes(ctx)
}

// verifyEnrolled verifies the enabled, unserved and pending pods one at a time (the
// drift pass is background work: gentle on the node beats fast).
func (a *Agent) verifyEnrolled(ctx context.Context) {
	uids := append(a.reg.UIDs(registry.Enabled), a.reg.UIDs(registry.Pending)...)
	uids = append(uids, a.reg.UIDs(registry.Unserved)...)
	for _, uid := range uids {
		if ctx.Err() != nil {
			return
		}
		a.verifyPod(ctx, uid)
	}
}

// repairHost re-asserts the node's host rules (probe SNAT and its jump).
func (a *Agent) repairHost(ctx context.Context) {
	d, err := a.rules.RepairHostRules(ctx)
	if err != nil {
		a.log.Warn("repairing host rules failed", "error", err)
		return
	}
	if !d.Empty() {
		a.metrics.repairs.WithLabelValues("host_rules").Inc()
		a.log.Warn("host rules drifted and were repaired", "drift", d.String())
	}
}

// pruneProbes makes the node's probe set hold exactly the IPs of the pods
// whose rules are in place (registry.ProbeEntry: pending, enabled, unserved):
// entries of pods gone (deleted while the agent was down, an IP since
// reused by another pod) or that left their sandbox are removed, missing
// ones added.
func (a *Agent) pruneProbes(ctx context.Context) {
	live := map[string][]netip.Addr{}
	for _, e := range a.reg.List() {
		if registry.ProbeEntry(e.Phase) && len(e.IPs) > 0 {
			live[e.UID] = e.IPs
		}
	}
	ch, err := a.rules.PruneProbeIPs(ctx, live)
	if err != nil {
		a.log.Warn("pruning the probe set failed", "error", err)
		return
	}
	if n := ch.Total(); n > 0 {
		// Entries, not passes: each one a probe that was or would have
		// been wrong. (A pod captured while the prune ran can be counted
		// once, as its entry is removed and given back below.)
		a.metrics.repairs.WithLabelValues("probe_set").Add(float64(n))
		a.log.Warn("probe set drifted and was repaired", "added", ch.Added, "relabelled", ch.Relabelled, "removed", ch.Removed)
	}
	// A pod captured while the prune ran may have lost the entry it had
	// just been given: add it back (AddProbeIPs is idempotent). One that
	// left its sandbox meanwhile may have been given one back: remove it.
	for _, e := range a.reg.List() {
		_, had := live[e.UID]
		switch want := registry.ProbeEntry(e.Phase) && len(e.IPs) > 0; {
		case want && !had:
			if err := a.rules.AddProbeIPs(ctx, e.UID, e.IPs); err != nil {
				a.log.Warn("re-adding probe IPs after the prune", "uid", e.UID, "error", err)
			}
		case !want && had:
			if err := a.rules.RemoveProbeIPs(ctx, e.UID, live[e.UID]); err != nil {
				a.log.Warn("removing probe IPs after the prune", "uid", e.UID, "error", err)
			}
		}
	}
}
