package agent

import (
	"context"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/nodeagent/registry"
)

// When the node's only ztunnel goes away (a crash, an OOM kill, a failed
// upgrade), every enabled pod's traffic is still redirected — to ports
// nobody listens on. Once no ztunnel has served the node for
// Config.ZtunnelGrace, the agent says so on every such pod: they are
// Unserved, condition False/ZtunnelUnavailable (the annotation stays
// `enabled`: the rules are in place), so Kubernetes takes them out of their
// Services. The first ztunnel that acks its snapshot takes them back
// (retryOnSnapshotAck: each is Added and Enabled again).
//
// "Serves" is ztunnel.Status.Serving: a connection that acked its snapshot.
// A rolling upgrade whose new ztunnel connects before the old one leaves
// (maxSurge) never has none, so it never starts the clock.

// Node Event reasons of the ztunnel's absence (docs/readiness.md).
const (
	// EventZtunnelUnavailable (Warning): no ztunnel served the node for
	// the grace; the message counts the pods now not ready.
	EventZtunnelUnavailable = "ZtunnelUnavailable"
	// EventZtunnelAvailable (Normal): a ztunnel acked its snapshot after
	// such an outage; the pods are being enabled again.
	EventZtunnelAvailable = "ZtunnelAvailable"
	// EventZtunnelNotResponding (Warning): as EventZtunnelUnavailable, when
	// the last ztunnel was dropped for not answering (hung).
	EventZtunnelNotResponding = "ZtunnelNotResponding"
)

// unservedWhy is the reason and the words for a node without a serving
// ztunnel: gone, or hung (dropped for not answering).
func (a *Agent) unservedWhy() (reason, event, what string) {
	if a.zt.Status().Unresponsive {
		return ReasonZtunnelNotResponding, EventZtunnelNotResponding, "the node's ztunnel stopped answering (hung: no ack within the timeout, its socket open) and no ztunnel has served the node since"
	}
	return ReasonZtunnelUnavailable, EventZtunnelUnavailable, "no ztunnel has served the node"
}

// servedState is whether the node has gone without a ztunnel for longer
// than the grace. Only followZtunnel writes it.
type servedState struct {
	mu sync.Mutex
	// since is when the node last went without a serving ztunnel (zero
	// while one serves).
	since time.Time
	// outage: since is older than the grace.
	outage bool
}

func (s *servedState) get() (since time.Time, outage bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.since, s.outage
}

func (s *servedState) set(since time.Time, outage bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.since, s.outage = since, outage
}

// ztunnelOutage reports whether the node has been without a serving
// ztunnel for longer than the grace — and still is: a ztunnel that acked
// its snapshot a moment ago ends it even before followZtunnel heard of it,
// so a sync that enables a pod again never sees a stale outage.
func (a *Agent) ztunnelOutage() bool {
	if _, outage := a.served.get(); !outage {
		return false
	}
	return a.zt.Status().Serving == 0
}

// ZtunnelReconnectAllowance is how long ztunnel may take to reconnect to a
// restarted agent: while the agent is down ztunnel keeps serving its pods
// and retries its connection with a back-off that doubles from 10 ms up to
// 15 s (ztunnel's CONNECTION_FAILURE_RETRY_DELAY_MAX_INTERVAL). So the
// first outage after the agent starts is declared only this long past the
// grace: an agent upgrade never flaps the pods of a node whose ztunnel is
// fine.
const ZtunnelReconnectAllowance = 15 * time.Second

// followZtunnel keeps servedState: on every change of the ztunnel server's
// status it notes when the node went without a serving ztunnel, and once
// that lasted the grace it declares the outage — every enabled pod is
// queued, and its sync makes it Unserved — with a Warning Event on the
// node. A ztunnel that acks its snapshot ends the outage (retryOnSnapshotAck
// queues the Unserved pods) with a Normal Event. The clock starts when the
// agent runs (a node whose ztunnel never connects is an outage too), with
// ZtunnelReconnectAllowance on top until a ztunnel has served.
func (a *Agent) followZtunnel(ctx context.Context, changed <-chan struct{}) {
	defer a.liveLoops.Add(-1)
	grace := a.cfg.ZtunnelGrace
	if grace <= 0 {
		<-ctx.Done() // off
		return
	}
	limit := grace + ZtunnelReconnectAllowance // until a ztunnel served
	timer := time.NewTimer(limit)
	defer timer.Stop()
	a.served.set(time.Now(), false)
	check := func() {
		since, outage := a.served.get()
		switch serving := a.zt.Status().Serving > 0; {
		case serving && !since.IsZero():
			timer.Stop()
			limit = grace
			a.served.set(time.Time{}, false)
			if outage {
				down := time.Since(since).Round(time.Millisecond)
				n := len(a.reg.UIDs(registry.Unserved))
				a.log.Info("a ztunnel serves the node again; enabling the pods marked unserved", "pods", n, "took", down)
				a.nodeEvent(corev1.EventTypeNormal, EventZtunnelAvailable,
					fmt.Sprintf("A ztunnel acked the node's snapshot after %v without one; %d pods are being enabled again", down, n))
			}
		case !serving && since.IsZero():
			a.served.set(time.Now(), false)
			timer.Reset(limit)
		case !serving && !outage && time.Since(since) >= limit:
			a.served.set(since, true)
			uids := a.reg.UIDs(registry.Enabled)
			reason, event, what := a.unservedWhy()
			a.log.Warn("no ztunnel has served the node for the grace; marking its enabled pods not ready", "grace", grace, "took", time.Since(since).Round(time.Millisecond), "pods", len(uids), "reason", reason)
			a.nodeEvent(corev1.EventTypeWarning, event,
				fmt.Sprintf("For %v %s: %d pods marked not ready (condition %s False, reason %s); their traffic is captured with no proxy behind it",
					time.Since(since).Round(time.Second), what, len(uids), a.cfg.PodConditionType, reason))
			for _, uid := range uids {
				a.queue.Add(uid)
			}
		case !serving && !outage:
			timer.Reset(time.Until(since.Add(limit)))
		}
	}
	check()
	for {
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case <-timer.C:
		}
		check()
	}
}

// unserved is the status change of an enabled pod during an outage
// (syncEnabled): Unserved, with the reason and why.
func (a *Agent) unserved(uid string) (registry.Entry, error) {
	reason, _, what := a.unservedWhy()
	return a.update(uid, func(x *registry.Entry) {
		x.Phase, x.Reason = registry.Unserved, reason
		x.LastError = fmt.Sprintf("%s for over %v: the pod's traffic is captured with no proxy behind it", what, a.cfg.ZtunnelGrace)
	})
}

// nodeEvent records an Event on the agent's node.
func (a *Agent) nodeEvent(eventType, reason, message string) {
	// As kubelet names its node in its Events (the Node's uid is not
	// needed to find them: kubectl describe node selects by name).
	ref := &corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: a.cfg.NodeName, UID: types.UID(a.cfg.NodeName)}
	a.recorder.Event(ref, eventType, reason, message)
}
