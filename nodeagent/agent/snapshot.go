package agent

import (
	"sync"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// Snapshot implements ztunnel.SnapshotSource from the registry.
func (a *Agent) Snapshot() []ztunnel.SnapshotEntry {
	list := a.reg.List()
	out := make([]ztunnel.SnapshotEntry, 0, len(list))
	for _, e := range list {
		if e.Phase == registry.Releasing {
			continue // being dropped: a new ztunnel must not take it
		}
		if e.Phase == registry.Uncaptured && e.Reason == ReasonSandboxChanged {
			// Its sandbox went (a DEL: ztunnel was told to drop it) or is
			// not the pod's any more: nothing to keep. It comes back with
			// an Add once its current sandbox is captured. (A pod whose
			// netns was not found after a restart is kept: its sandbox
			// may well live on with our rules, and ztunnel with it.)
			continue
		}
		h := e.Netns
		if h != nil && a.finder.IsHost(h) {
			h = nil // never hand ztunnel the node's own netns (Keep instead)
		}
		out = append(out, ztunnel.SnapshotEntry{
			Workload: ztunnel.Workload{UID: e.UID, Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount},
			Netns:    h,
		})
	}
	return out
}

// SnapshotRefused implements ztunnel.SnapshotRefusalObserver: a pod that a
// (new) ztunnel refused in its snapshot is not carried by it, whatever the
// agent believed. The pod's sync takes it (under the pod's lock) back to
// pending and sends it again. This must not block: the ztunnel server calls
// it mid-snapshot, while a sync holding the pod's lock may be waiting for
// that very connection to take its Add.
func (a *Agent) SnapshotRefused(uid string, _ error) {
	a.refused.add(uid)
	a.queue.Add(uid)
}

// takeRefusal reports whether uid was refused in a snapshot since the last
// call, and forgets it.
func (a *Agent) takeRefusal(uid string) bool { return a.refused.take(uid) }

// handoverSet holds the pods a closed ztunnel connection held, to be Added
// to the newest one by their next sync, with the server's report callbacks.
type handoverSet struct {
	mu sync.Mutex
	m  map[string][]func(error)
}

// HandOver implements ztunnel.HandoverSink: the pod's next sync (queued
// here, run under the pod's lock) sends the Add, so an Add can never land
// after a release's Del. report, if not nil, is told the Add's result.
func (a *Agent) HandOver(uid string, report func(error)) {
	a.handovers.mu.Lock()
	if a.handovers.m == nil {
		a.handovers.m = map[string][]func(error){}
	}
	a.handovers.m[uid] = append(a.handovers.m[uid], report)
	a.handovers.mu.Unlock()
	a.queue.Add(uid)
}

// take reports whether uid is waiting to be handed over (its reports stay
// until done).
func (h *handoverSet) take(uid string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, ok := h.m[uid]
	return ok
}

// drop forgets uid's handover without reporting (the pod was released).
func (h *handoverSet) drop(uid string) {
	h.mu.Lock()
	delete(h.m, uid)
	h.mu.Unlock()
}

// done returns the function that reports an Add of uid to whoever asked
// for a handover, and forgets them.
func (h *handoverSet) done(uid string) func(error) {
	h.mu.Lock()
	reports := h.m[uid]
	delete(h.m, uid)
	h.mu.Unlock()
	return func(err error) {
		for _, r := range reports {
			if r != nil {
				r(err)
			}
		}
	}
}
