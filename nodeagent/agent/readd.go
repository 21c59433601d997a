package agent

import "sync"

// The re-add: when a ztunnel connection closes while another remains, the
// pods it held are Added to the remaining one (nodeagent/ztunnel asks, the
// pod's sync sends). Handing the node to another agent at uninstall is
// handover.go.

// readdSet holds the pods a closed ztunnel connection held, to be Added to
// the newest one by their next sync, with the server's report callbacks.
type readdSet struct {
	mu sync.Mutex
	m  map[string][]func(error)
}

// Readd implements ztunnel.SnapshotSource's Readd: the pod a closed ztunnel
// connection held is Added to the newest one by its next sync (queued here,
// run under the pod's lock), so an Add can never land after a release's Del.
// report, if not nil, is told the Add's result.
func (a *Agent) Readd(uid string, report func(error)) {
	a.readds.mu.Lock()
	if a.readds.m == nil {
		a.readds.m = map[string][]func(error){}
	}
	a.readds.m[uid] = append(a.readds.m[uid], report)
	a.readds.mu.Unlock()
	a.queue.Add(uid)
}

// take reports whether uid is waiting to be re-added (its reports stay
// until done).
func (r *readdSet) take(uid string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.m[uid]
	return ok
}

// drop forgets uid's re-add without reporting (the pod was released).
func (r *readdSet) drop(uid string) {
	r.mu.Lock()
	delete(r.m, uid)
	r.mu.Unlock()
}

// done returns the function that reports an Add of uid to whoever asked
// for its re-add, and forgets them.
func (r *readdSet) done(uid string) func(error) {
	r.mu.Lock()
	reports := r.m[uid]
	delete(r.m, uid)
	r.mu.Unlock()
	return func(err error) {
		for _, report := range reports {
			if report != nil {
				report(err)
			}
		}
	}
}
