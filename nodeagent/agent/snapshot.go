package agent

import (
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
