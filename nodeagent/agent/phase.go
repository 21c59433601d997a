package agent

import (
	"sync"

	"github.com/ambientd/ambientd/nodeagent/registry"
)

// update is the agent's one way to change a pod in the registry (callers hold
// the pod's lock). It remembers that the pod's phase moved, so the sync that
// made the move publishes the derived status once, at its end.
func (a *Agent) update(uid string, fn func(*registry.Entry)) (registry.Entry, error) {
	before, _ := a.reg.Get(uid)
	e, err := a.reg.Update(uid, fn)
	if err == nil && e.Phase != before.Phase {
		a.moved.add(uid)
		if e.Phase == registry.Enabled {
			a.metrics.enrollments.Inc()
		}
	}
	return e, err
}

// takeMoved reports whether uid's phase moved since the last call, and
// forgets it.
func (a *Agent) takeMoved(uid string) bool { return a.moved.take(uid) }

// uidSet is a set of pod uids safe for concurrent use.
type uidSet struct {
	mu sync.Mutex
	m  map[string]bool
}

func (s *uidSet) add(uid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]bool{}
	}
	s.m[uid] = true
}

// take reports whether uid is in the set and removes it.
func (s *uidSet) take(uid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	in := s.m[uid]
	delete(s.m, uid)
	return in
}
