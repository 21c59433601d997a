package agent

import (
	"sync"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/podmeta"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
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

// statusFor derives what a pod in entry e's phase shows the cluster; ok is
// false when the phase has no say (Unverified and Releasing keep whatever the
// pod shows; a pod that is gone has nothing to show). This is the one place
// the status is derived: a new status field (e.g. the pod condition
// ambient.istio.io/enrolled, with e.LastError as its message) is derived here
// and added to podstatus.Status.
func statusFor(e registry.Entry) (st podstatus.Status, ok bool) {
	switch e.Phase {
	case registry.Enabled:
		return podstatus.Status{Redirection: podmeta.RedirectionEnabled}, true
	case registry.Pending:
		return podstatus.Status{Redirection: podmeta.RedirectionPending}, true
	case registry.Absent:
		return podstatus.Status{}, !e.Gone
	}
	return podstatus.Status{}, false
}

// shows returns what pod shows now, in statusFor's terms.
func shows(pod *corev1.Pod) (podstatus.Status, bool) {
	v, ok := pod.Annotations[podmeta.AnnotationRedirection]
	return podstatus.Status{Redirection: v}, ok
}

// publish queues the status write a sync calls for: after a phase move
// always; otherwise only to heal a pod that shows something else than its
// phase says (a write lost during an API outage, a hand edit, a ztunnel that
// refused the pod). A pod the agent does not hold is only cleaned when it is
// out of the mesh and not finished (a terminal pod's network is gone).
func (a *Agent) publish(s podSync, after registry.Entry, moved bool) {
	pod := s.pod
	if pod == nil {
		return
	}
	want, ok := statusFor(after)
	if !ok {
		return
	}
	cur, has := shows(pod)
	switch {
	case moved:
	case after.Phase == registry.Absent:
		terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
		if s.inMesh || terminal || !has {
			return
		}
	case has && cur == want:
		return
	}
	a.status.Set(pod.Namespace, pod.Name, string(pod.UID), want)
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
