package agent

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// PodView is what the agent knows about one of this node's pods, for
// `ambientd status`: its phase (registry.Absent for a pod the agent does
// not hold), the redirection annotation the pod shows, why it is not
// enabled, and its creation time.
type PodView struct {
	UID, Namespace, Name string
	Phase                registry.Phase
	Annotation           string // value of the redirection annotation, "" when absent
	LastError            string
	Created              time.Time // zero for a registered pod the cache no longer has
	IPs                  []string
	Netns                string // path of the held netns handle, "" when none
	// MissingGate: in the mesh, but created without the readiness gate
	// admission adds (missinggate.go).
	MissingGate bool
}

// Pods returns every pod of this node in the informer cache, plus any
// registered pod the cache no longer has, sorted by namespace and name. It
// takes no per-pod lock: a view, not a decision.
func (a *Agent) Pods() []PodView {
	seen := map[string]bool{}
	var out []PodView
	for _, obj := range a.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			continue
		}
		uid := string(p.UID)
		seen[uid] = true
		v := PodView{UID: uid, Namespace: p.Namespace, Name: p.Name, Phase: registry.Absent,
			Annotation: p.Annotations[podmeta.AnnotationRedirection], Created: p.CreationTimestamp.Time, MissingGate: a.lacksGate(p)}
		for _, ip := range podmeta.IPs(p) {
			v.IPs = append(v.IPs, ip.String())
		}
		if e, ok := a.reg.Get(uid); ok {
			fillFromEntry(&v, e)
		}
		out = append(out, v)
	}
	for _, e := range a.reg.List() {
		if seen[e.UID] {
			continue
		}
		v := PodView{UID: e.UID, Namespace: e.Namespace, Name: e.Name}
		fillFromEntry(&v, e)
		out = append(out, v)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out
}

func fillFromEntry(v *PodView, e registry.Entry) {
	v.Phase, v.LastError = e.Phase, e.LastError
	if len(v.IPs) == 0 {
		for _, ip := range e.IPs {
			v.IPs = append(v.IPs, ip.String())
		}
	}
	if e.Netns != nil {
		v.Netns = e.Netns.Path()
	}
}

// ErrNoNetns is returned by PodRules for a pod the agent holds no network
// namespace of.
var ErrNoNetns = errors.New("agent holds no network namespace for the pod")

// PodRules returns the live rules in the netns of the registered pod uid.
// It takes no lock (a status query never waits behind a sync): a handle
// closed meanwhile makes the read fail with podnetns.ErrClosed, never read
// another namespace.
func (a *Agent) PodRules(ctx context.Context, uid string) (string, error) {
	e, ok := a.reg.Get(uid)
	if !ok || e.Netns == nil {
		return "", fmt.Errorf("pod %s: %w", uid, ErrNoNetns)
	}
	return a.rules.DumpPod(ctx, e.Netns)
}
