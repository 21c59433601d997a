package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// SuccessorRules is the rule backend of the node agent that takes the node
// over (*iptables.Manager built for that backend implements it; which agent
// that is, is an iptables.Successor). ApplyPod writes the pod's rules there
// and then removes ours from every other backend, so the pod is never
// without capture and ends with one set of rules; VerifyPod reads them back
// from the kernel.
type SuccessorRules interface {
	ApplyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) error
	VerifyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) (iptables.Drift, error)
}

// DefaultHandOverTimeout bounds a handover (within the DaemonSet's 30 s
// termination grace period, with time left for the uninstall after it).
const DefaultHandOverTimeout = 15 * time.Second

// handOver runs when Run stops, after the workers (and, in the daemon, the
// CNI and ztunnel servers and the drift pass) have stopped and before the
// registry closes: nothing else changes a pod's rules meanwhile. It asks
// Config.HandOver whether another agent takes the node over; if so, every
// registered pod still in the mesh gets its rules moved to that agent's
// backend, and every registered pod no longer in the mesh (or whose object
// is gone) loses its rules: the incoming agent finds exactly the pods it
// will consider enrolled captured, each once, in the backend it looks at.
// The pods' annotations are left as they are (the incoming agent reads
// them), and ztunnel is not told anything: it keeps serving the pods until
// the incoming agent's snapshot.
func (a *Agent) handOver() {
	if a.cfg.HandOver == nil && a.cfg.Uninstalling == nil {
		return
	}
	timeout := a.cfg.HandOverTimeout
	if timeout <= 0 {
		timeout = DefaultHandOverTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var to SuccessorRules
	if a.cfg.HandOver != nil {
		var err error
		if to, err = a.cfg.HandOver(ctx); err != nil {
			a.log.Error("handover: cannot tell the successor's rule backend; pods keep their rules in ours", "error", err)
			return
		}
	}
	if to == nil {
		if a.cfg.Uninstalling != nil && a.cfg.Uninstalling(ctx) {
			a.releaseAtUninstall(ctx)
		}
		return
	}
	start := time.Now()
	var entries []registry.Entry
	for _, e := range a.reg.List() {
		switch {
		case e.Phase == registry.Releasing:
			// Its rules are already gone (or going with the pod).
		case e.Netns == nil:
			a.podLog(e.Namespace, e.Name, e.UID).Warn("handover: the pod's network namespace was never found; its rules, if any, stay as they are")
		default:
			entries = append(entries, e)
		}
	}
	var moved, released, failed atomic.Int64
	var movedMu sync.Mutex
	movedUIDs := map[string]bool{} // rules in place in the successor's backend
	work := make(chan registry.Entry)
	var wg sync.WaitGroup
	for range min(a.cfg.Workers, max(len(entries), 1)) {
		wg.Go(func() {
			for e := range work {
				switch a.handOverPod(ctx, to, e) {
				case handOverMoved:
					moved.Add(1)
					movedMu.Lock()
					movedUIDs[e.UID] = true
					movedMu.Unlock()
				case handOverReleased:
					released.Add(1)
				default:
					failed.Add(1)
				}
			}
		})
	}
	for _, e := range entries {
		work <- e
	}
	close(work)
	wg.Wait()
	log := a.log.Info
	if failed.Load() > 0 {
		log = a.log.Error
	}
	log("handover: pods' rules moved to the successor's backend", "moved", moved.Load(), "released", released.Load(), "failed", failed.Load(), "took", time.Since(start).Round(time.Millisecond))
	a.releaseConditions(ctx, movedUIDs)
}

// releaseConditions settles, at a handover, the condition of every pod of
// the node the agent holds whose condition is False — the successor
// (Istio's istio-cni) never writes it, so what is left is what a gated pod
// shows for ever:
//
//   - rules moved into the successor's backend and read back there
//     (moved): True/HandedOver —
//     captured, and the successor adds it to ztunnel (the no-deadlock rule,
//     gate.go); the annotation stays, for the successor to read;
//   - unserved (no ztunnel served the node for the grace): left
//     False/ZtunnelUnavailable — black-holed, and it says so;
//   - rules not moved (the move failed, they did not read back as
//     written, or its network namespace was never found):
//     False/NotHandedOver — its capture is not known.
//
// True pods and pods the agent does not hold are left as they are.
func (a *Agent) releaseConditions(ctx context.Context, moved map[string]bool) {
	n := 0
	for _, h := range a.heldFalse() {
		var want podstatus.Status
		write := false
		switch {
		case h.entry.Phase == registry.Unserved:
			// Black-holed (no ztunnel served the node for the grace):
			// its False/ZtunnelUnavailable says what is wrong, and stays
			// true under the successor until a ztunnel serves.
		case moved[string(h.pod.UID)]:
			// Its rules are in place in the successor's backend: the
			// successor adds it to ztunnel.
			want, write = handedOver(h.cur)
		default:
			want, write = notHandedOver(h.cur)
		}
		if write {
			a.status.Set(h.pod.Namespace, h.pod.Name, string(h.pod.UID), want)
			n++
		}
	}
	if n == 0 {
		return
	}
	if err := a.status.Flush(ctx); err != nil {
		a.log.Error("handover: pods whose condition was False may stay NotReady", "pods", n, "error", err)
		return
	}
	a.log.Info("handover: pods whose condition was False set True (the successor keeps no condition)", "pods", n)
}

// heldPod is a pod the agent holds, its registry entry and the status it
// shows.
type heldPod struct {
	pod   *corev1.Pod
	entry registry.Entry
	cur   podstatus.Status
}

// heldFalse lists the pods the agent holds whose condition is False, as
// their phase derives it rather than only as the informer shows it: a
// False written (or queued) just before the stop may not have come back
// through the watch yet, and a gated pod left False would be NotReady for
// ever. What settles them as the agent stops (a handover, an uninstall)
// walks these; pods it does not hold keep what it last wrote.
func (a *Agent) heldFalse() []heldPod {
	var out []heldPod
	for _, obj := range a.podInformer.GetStore().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok {
			continue
		}
		e, held := a.reg.Get(string(pod.UID))
		if !held {
			continue
		}
		cur, _ := a.shows(pod)
		if st, ok := statusFor(e, true); ok {
			cur = st
		}
		if cur.Condition.Status == corev1.ConditionFalse {
			out = append(out, heldPod{pod: pod, entry: e, cur: cur})
		}
	}
	return out
}

type handOverResult int

const (
	handOverFailed handOverResult = iota
	handOverMoved
	handOverReleased
)

// handOverPod moves one pod's rules (or, out of the mesh, removes them).
func (a *Agent) handOverPod(ctx context.Context, to SuccessorRules, e registry.Entry) handOverResult {
	log := a.podLog(e.Namespace, e.Name, e.UID)
	pod := a.podByUID(e.UID)
	inMesh := pod != nil
	if pod != nil {
		// The informer stopped with the agent; its cache is the last word
		// the agent had. A decision it cannot make keeps the pod captured.
		if d, err := a.decide(ctx, pod); err == nil && !d.InMesh {
			inMesh = false
		}
	}
	if !inMesh {
		if err := a.rules.DeletePod(ctx, e.Netns); err != nil {
			log.Error("handover: removing the rules of a pod out of the mesh", "error", err)
			return handOverFailed
		}
		log.Info("handover: pod out of the mesh; its rules removed")
		return handOverReleased
	}
	// The options its rules were built (or last verified) with: what the
	// pod has. Re-parsing the annotations would lose a value that turned
	// invalid since, and every option with it.
	if err := to.ApplyPod(ctx, e.Netns, e.Options); err != nil {
		log.Error("handover: moving the pod's rules to the successor's backend failed; it keeps ours", "error", err)
		return handOverFailed
	}
	// Read back, as the drift pass does: only rules the kernel shows in
	// place let the pod be called handed over (True) — a write that
	// reported success but left a rule out would be a Ready pod whose
	// traffic is not captured.
	drift, err := to.VerifyPod(ctx, e.Netns, e.Options)
	switch {
	case err != nil:
		log.Error("handover: the pod's rules in the successor's backend could not be read back", "error", err)
		return handOverFailed
	case !drift.Empty():
		log.Error("handover: the pod's rules in the successor's backend differ from what was written", "drift", drift.String())
		return handOverFailed
	}
	log.Debug("handover: pod's rules moved and read back")
	return handOverMoved
}
