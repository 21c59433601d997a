package agent

import (
	"context"
	"sync"
	"time"

	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/nodeagent/registry"
)

// Run waits for the informer caches (the owner started the informers),
// rebuilds the registry from the API and /proc (so a restarted agent's first
// ztunnel snapshot holds every live pod), then calls ready — the daemon
// starts the ztunnel and CNI servers only then — and runs the workers until
// ctx ends. It returns nil when ctx ends. The registry is closed when Run
// returns.
func (a *Agent) Run(ctx context.Context, ready func()) error {
	if a.state != nil {
		defer a.state.Close() // last: the journal's descriptor
	}
	defer a.reg.Close()
	defer a.handOver() // after the workers, before the registry closes
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	a.log.Info("waiting for informer caches", "node", a.cfg.NodeName)
	if !cache.WaitForCacheSync(ctx.Done(), a.podInformer.HasSynced, a.nsInformer.HasSynced) {
		return nil // ctx ended before the caches synced: a clean stop
	}
	a.synced.Store(true)

	a.rebuild(ctx)

	acked, unsubscribe := a.zt.SubscribeSnapshotAcked()
	defer unsubscribe()
	status, unsubscribeStatus := a.zt.SubscribeStatus()
	defer unsubscribeStatus()
	a.wantLoops = int32(a.cfg.Workers) + 2
	// Loops count as live from before they start, so /healthz never sees a
	// loop "missing" that simply has not been scheduled yet; each one takes
	// itself off the count when it returns.
	a.liveLoops.Add(a.wantLoops)
	wg.Go(func() { a.retryOnSnapshotAck(ctx, acked) })
	wg.Go(func() { a.followZtunnel(ctx, status) })
	for range a.cfg.Workers {
		wg.Go(func() { a.worker(ctx) })
	}
	context.AfterFunc(ctx, a.queue.ShutDown)
	a.running.Store(true)
	a.log.Info("agent running", "node", a.cfg.NodeName, "pods", a.reg.Len())
	ready()
	<-ctx.Done()
	return nil
}

// RunStatusWriter writes queued pod status until ctx ends (the daemon runs
// it beside the agent, and stops it after the agent).
func (a *Agent) RunStatusWriter(ctx context.Context) error {
	a.status.Run(ctx, 2)
	return nil
}

// retryOnSnapshotAck retries every pending pod as soon as a ztunnel acks its
// snapshot: the pod may have been sent as Add in the snapshot, but the server
// does not report per-pod results, so a fresh Add (a no-op for ztunnel if it
// already has the pod) is what proves the pod is taken over.
func (a *Agent) retryOnSnapshotAck(ctx context.Context, acked <-chan struct{}) {
	defer a.liveLoops.Add(-1)
	for {
		select {
		case <-ctx.Done():
			return
		case <-acked:
			a.lastAck.Store(time.Now().UnixNano())
			pending := append(a.reg.UIDs(registry.Pending), a.reg.UIDs(registry.Unverified)...)
			pending = append(pending, a.reg.UIDs(registry.Uncaptured)...)
			pending = append(pending, a.reg.UIDs(registry.Unserved)...)
			if len(pending) > 0 {
				a.log.Info("ztunnel snapshot acked, retrying pending pods", "pending", len(pending))
			}
			for _, uid := range pending {
				a.metrics.retries.WithLabelValues("snapshot_ack").Inc()
				a.queue.Add(uid)
			}
		}
	}
}

func (a *Agent) worker(ctx context.Context) {
	defer a.liveLoops.Add(-1)
	for {
		uid, quit := a.queue.Get()
		if quit {
			return
		}
		_, err := a.sync(ctx, uid, nil)
		switch {
		case err == nil:
			a.queue.Forget(uid)
		case ctx.Err() != nil:
			a.queue.Forget(uid)
		default:
			a.metrics.retry(err)
			a.queue.AddRateLimited(uid)
		}
		a.queue.Done(uid)
	}
}
