package agent

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// countingNetns counts the namespaces the agent opens by path (Netns.Open:
// a CNI ADD's netns; nothing else opens by path).
type countingNetns struct {
	Netns
	opens atomic.Int32
}

func (c *countingNetns) Open(path string) (*podnetns.Handle, error) {
	c.opens.Add(1)
	return c.Netns.Open(path)
}

// addMark marks the context of the ADD under test: the policy decisions
// made with it are the ADD's (the workqueue decides about the same pod
// concurrently, with its own context).
type addMark struct{}

// sidecarRules records where sidecar mode programmed rules (the id of the
// netns it was handed).
type sidecarRules struct {
	mu      sync.Mutex
	applied []podnetns.ID
}

func (r *sidecarRules) ApplySidecar(_ context.Context, n ns.NetNS, _ iptables.SidecarOptions, _ *iptables.SidecarOptions) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	id, err := podnetns.IDOf(n.Path())
	if err != nil {
		return err
	}
	r.applied = append(r.applied, id)
	return nil
}

func (*sidecarRules) VerifySidecar(context.Context, ns.NetNS, iptables.SidecarOptions) (iptables.Drift, error) {
	return iptables.Drift{}, nil
}

func (*sidecarRules) DeleteSidecar(context.Context, ns.NetNS, *iptables.SidecarOptions) error {
	return nil
}

// injectedPod is a pod Istio's injector gave an istio-proxy: the policy
// makes it a sidecar pod.
func injectedPod(ns, name, uid string) *corev1.Pod {
	p := pod(ns, name, uid, map[string]string{podmeta.AnnotationSidecarStatus: "{}"})
	p.Spec.Containers = []corev1.Container{
		{Name: "app"},
		{Name: podmeta.ContainerProxy, Args: []string{"proxy", "sidecar"}},
	}
	return p
}

// TestCNIAddDecidesOnceOpensOnce: every CNI ADD — an ambient pod, a sidecar
// pod and a pod in neither mesh, with sidecar mode on and off — evaluates
// the enrollment policy once and opens the pod's (real) network namespace
// once, and the pod ends in its mode.
func TestCNIAddDecidesOnceOpensOnce(t *testing.T) {
	for _, tc := range []struct {
		name    string
		sidecar bool
		pod     *corev1.Pod
		want    Outcome
	}{
		{"ambient, sidecar mode on", true, pod("app", "a", "uid-a", nil), Enrolled},
		{"sidecar pod, sidecar mode on", true, injectedPod("plain", "s", "uid-s"), SidecarCaptured},
		{"none, sidecar mode on", true, pod("plain", "n", "uid-n", nil), NotInMesh},
		{"ambient, sidecar mode off", false, pod("app", "a", "uid-a", nil), Enrolled},
		{"sidecar pod, sidecar mode off", false, injectedPod("plain", "s", "uid-s"), NotInMesh},
		{"none, sidecar mode off", false, pod("plain", "n", "uid-n", nil), NotInMesh},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opener := &countingNetns{}
			var decisions atomic.Int32
			srules := &sidecarRules{}
			opts := []harnessOption{
				withRealNetns(),
				withObjects(namespace("app", true), namespace("plain", false), tc.pod),
				withNetnsWrapper(func(n Netns) Netns { opener.Netns = n; return opener }),
				beforeRun(func(h *harness) {
					a := h.agent
					decide := a.decide
					a.decide = func(ctx context.Context, p *corev1.Pod) (policy.Decision, error) {
						if ctx.Value(addMark{}) != nil {
							decisions.Add(1)
						}
						return decide(ctx, p)
					}
					if !tc.sidecar {
						return
					}
					tr, err := sidecar.New(sidecar.Config{NodeName: node, Policy: a.cfg.Policy}, srules, a.PodInformer(), nil, a.Metrics(), nil)
					if err != nil {
						t.Fatal(err)
					}
					h.cni.SetSidecar(tr, sidecar.ErrInvalidAnnotation)
				}),
			}
			h := newHarness(t, opts...)
			h.zt.connect()
			ev := h.event(tc.pod)
			ctx := context.WithValue(t.Context(), addMark{}, true)
			out, err := h.cni.HandleAdd(ctx, ev)
			if err != nil || out != tc.want {
				t.Fatalf("HandleAdd = %v, %v; want %v", out, err, tc.want)
			}
			if n := decisions.Load(); n != 1 {
				t.Errorf("the ADD evaluated the enrollment policy %d times, want once", n)
			}
			if n := opener.opens.Load(); n != 1 {
				t.Errorf("the ADD opened the pod's netns %d times, want once", n)
			}
			// Sidecar mode programmed the pod in the namespace the ADD
			// opened, and no other pod.
			var want []podnetns.ID
			if tc.want == SidecarCaptured {
				id, err := podnetns.IDOf(ev.NetnsPath)
				if err != nil {
					t.Fatal(err)
				}
				want = []podnetns.ID{id}
			}
			srules.mu.Lock()
			applied := srules.applied
			srules.mu.Unlock()
			if !slices.Equal(applied, want) {
				t.Errorf("sidecar rules programmed in netns %v, want %v", applied, want)
			}
			if tc.want == Enrolled && h.state(string(tc.pod.UID)) != "enabled" {
				t.Errorf("ambient pod is %s, want enabled", h.state(string(tc.pod.UID)))
			}
		})
	}
}
