package agent

import (
	"sort"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/podopts"
)

// invalidSeen remembers, per pod, the invalid annotation values an Event
// was recorded for, so a pod synced again and again is told once.
type invalidSeen struct {
	mu sync.Mutex
	m  map[string]string
}

func (s *invalidSeen) changed(uid, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]string{}
	}
	if s.m[uid] == key {
		return false
	}
	if key == "" {
		delete(s.m, uid)
	} else {
		s.m[uid] = key
	}
	return true
}

func (s *invalidSeen) forget(uid string) { s.changed(uid, "") }

// noteInvalid records a Warning Event for the pod's invalid annotation
// values (once per distinct set), saying what the agent does instead.
func (a *Agent) noteInvalid(pod *corev1.Pod, enrolled bool, invalid []*podopts.InvalidAnnotationError) {
	var keys []string
	for _, e := range invalid {
		keys = append(keys, e.Annotation+"="+e.Value)
	}
	sort.Strings(keys)
	if !a.invalid.changed(string(pod.UID), strings.Join(keys, "\x00")) || len(invalid) == 0 {
		return
	}
	for _, e := range invalid {
		a.metrics.failure("bad_annotation")
		var does string
		switch {
		case enrolled:
			does = "ignored: the pod keeps the value it was enrolled with, and is verified against it"
		case e.OnInvalid == podopts.RefuseNew:
			does = "the pod is not enrolled (its CNI ADD fails) until the value is fixed"
		default:
			does = "ignored (as Istio does): the node's default applies"
		}
		a.recorder.Event(refOf(pod.Namespace, pod.Name, string(pod.UID)), corev1.EventTypeWarning, EventInvalidAnnotation, e.Error()+"; "+does)
	}
}
