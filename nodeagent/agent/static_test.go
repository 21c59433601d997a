package agent

import (
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// A static pod as the kubelet runs it: under the uid of its manifest hash
// (what the runtime passes as K8S_POD_UID and names the pod's cgroup
// after); the API shows its mirror pod, with an API-assigned uid, owned by
// the Node, annotated with the static uid.
const (
	staticUID = "6a1b2c3d4e5f60718293a4b5c6d7e8f9"     // kubelet's md5 hex of the manifest
	mirrorUID = "0f8e9d2c-1b3a-4c5d-8e7f-9a0b1c2d3e4f" // the apiserver's
)

// mirrorPod is the mirror pod of a static pod named name running on node
// under staticUID.
func mirrorPod(ns, name string) *corev1.Pod {
	p := pod(ns, name, mirrorUID, map[string]string{
		podmeta.AnnotationConfigMirror: staticUID,
		podmeta.AnnotationConfigHash:   staticUID,
		"kubernetes.io/config.source":  "file",
	})
	p.Spec.ServiceAccountName = "" // the ServiceAccount admission forbids them on mirror pods
	yes := true
	p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: node, UID: "node-uid", Controller: &yes}}
	return p
}

// staticEvent is the runtime's CNI event for the static pod behind p.
func (h *harness) staticEvent(p *corev1.Pod) PodEvent {
	ev := h.event(p)
	ev.UID = staticUID
	return ev
}

// TestStaticPodOutOfMeshStartsAtOnce: a static pod in a namespace that is
// not in the mesh is left alone at its CNI ADD — it is never failed for
// carrying the runtime's uid rather than its mirror pod's, and the ADD does
// not wait out the pod lookup for a uid the API will never show. Also when
// its mirror pod is not in the API (yet, or ever: the kubelet could not
// create it): the runtime's uid says it is no API pod, and only the
// namespace could put it in the mesh.
func TestStaticPodOutOfMeshStartsAtOnce(t *testing.T) {
	for _, withMirror := range []bool{true, false} {
		name := map[bool]string{true: "mirror in the API", false: "no mirror pod"}[withMirror]
		t.Run(name, func(t *testing.T) {
			objs := []runtime.Object{namespace("plain", false)}
			p := runningPod(mirrorPod("plain", "dns-cache-"+node), "127.0.0.1")
			if withMirror {
				objs = append(objs, p)
			}
			const lookup = 3 * time.Second
			h := newHarness(t, withConfig(func(c *Config) { c.PodLookupTimeout = lookup }), withObjects(objs...))
			h.zt.connect()
			start := time.Now()
			out, err := h.cni.HandleAdd(t.Context(), h.staticEvent(p))
			took := time.Since(start)
			if err != nil || out != NotInMesh {
				t.Fatalf("HandleAdd of a static pod out of the mesh = %v, %v (after %v), want NotInMesh", out, err, took)
			}
			if took >= lookup {
				t.Errorf("the ADD waited %v, the whole pod lookup", took)
			}
			if h.reg.Len() != 0 || h.zt.added(mirrorUID)+h.zt.added(staticUID) != 0 {
				t.Errorf("a pod out of the mesh was registered (%d) or Added to ztunnel", h.reg.Len())
			}
		})
	}
}

// TestStaticPodInMesh: a static pod in an ambient namespace is found by
// namespace/name (its mirror pod, whose config.mirror is the runtime's
// uid), enrolled under the mirror pod's uid — the one the API, the status
// write and ztunnel all use — and released at its DEL, which carries the
// runtime's uid.
func TestStaticPodInMesh(t *testing.T) {
	p := runningPod(mirrorPod("app", "agent-"+node), "127.0.0.1")
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.zt.connect()
	out, err := h.cni.HandleAdd(t.Context(), h.staticEvent(p))
	if err != nil || out != Enrolled {
		t.Fatalf("HandleAdd of a static pod in the mesh = %v, %v, want Enrolled", out, err)
	}
	if h.zt.added(mirrorUID) != 1 || h.zt.added(staticUID) != 0 {
		t.Errorf("ztunnel Adds: mirror uid %d, static uid %d; want the mirror's once", h.zt.added(mirrorUID), h.zt.added(staticUID))
	}
	if s := h.state(mirrorUID); s != "enabled" {
		t.Errorf("registry: mirror uid %s", s)
	}
	h.waitFor("mirror pod annotated enabled", func() bool { v, _ := h.annotation("app", p.Name); return v == "enabled" })

	// The manifest is removed: the kubelet deletes the mirror pod and tears
	// the sandbox down (DEL with the runtime's uid).
	if err := h.client.CoreV1().Pods("app").Delete(t.Context(), p.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := h.cni.HandleDel(t.Context(), h.staticEvent(p)); err != nil {
		t.Fatalf("HandleDel: %v", err)
	}
	h.waitFor("static pod released", func() bool { return h.state(mirrorUID) == "absent" && h.zt.deleted(mirrorUID) })
	if _, _, probes := h.rules.counts(); probes != 0 {
		t.Errorf("%d probe entries left after the release", probes)
	}
}

// TestStaticPodDelKeepsMirror: a DEL of a static pod's sandbox whose mirror
// pod stays (the kubelet recreates the sandbox) makes the pod uncaptured
// under the mirror's uid until its next sandbox is enrolled — the DEL's
// runtime uid reaches the pod.
func TestStaticPodDelKeepsMirror(t *testing.T) {
	p := runningPod(mirrorPod("app", "agent-"+node), "127.0.0.1")
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	if err := h.cni.HandleDel(t.Context(), h.staticEvent(p)); err != nil {
		t.Fatalf("HandleDel: %v", err)
	}
	if s := h.state(mirrorUID); s != "uncaptured" || !h.zt.deleted(mirrorUID) {
		t.Errorf("after the DEL of its sandbox: %s, ztunnel Del %v; want uncaptured and a Del", s, h.zt.deleted(mirrorUID))
	}
}

// TestStaticPodFoundAfterRestart: a restarted agent finds an enrolled static
// pod by the /proc scan — its cgroup names the static uid, not the mirror
// pod's — and restores it enabled.
func TestStaticPodFoundAfterRestart(t *testing.T) {
	hostProc := t.TempDir()
	fakeSandbox(t, hostProc, 100, staticUID, netnsWith(t, "10.1.7.7").NS.Path())
	p := runningPod(mirrorPod("app", "agent-"+node), "10.1.7.7")
	p.Annotations[podmeta.AnnotationRedirection] = podmeta.RedirectionEnabled
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), p))
	e, ok := h.reg.Get(mirrorUID)
	if !ok || e.Netns == nil || e.Phase != registry.Enabled {
		t.Fatalf("after the restart: %+v (registered %v), want enabled with its netns", e, ok)
	}
	h.zt.connect()
	if snap := h.firstSnapshot(); len(snap) != 1 || snap[0].Netns == nil {
		t.Errorf("first snapshot %+v, want the static pod with its netns", snap)
	}
}

// TestMirrorClaimRefused: config.mirror is pod metadata anyone who can
// create a pod can write. Only a pod the kubelet's Node owns may say which
// runtime uid it stands for, and never one that is another pod's API uid:
// otherwise a pod could have another pod's sandbox — found by its cgroup at
// a restart, or named by a CNI ADD — enrolled as itself, and that pod's
// traffic proxied with its identity.
func TestMirrorClaimRefused(t *testing.T) {
	const victimUID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
	forged := func(name, claim string, ownedByNode bool) *corev1.Pod {
		p := mirrorPod("app", name)
		p.UID = types.UID("uid-" + name)
		p.Annotations[podmeta.AnnotationConfigMirror] = claim
		p.Annotations[podmeta.AnnotationRedirection] = podmeta.RedirectionEnabled
		if !ownedByNode {
			p.OwnerReferences = nil
		}
		return runningPod(p, "10.1.8.8") // the victim's netns holds it too: only the claim decides
	}
	victim := runningPod(pod("plain", "victim", victimUID, nil), "10.1.8.8")
	notOwned := forged("not-owned", victimUID, false)
	stealsAPIUID := forged("steals", victimUID, true)
	otherNode := forged("other-node", staticUID, true)
	otherNode.OwnerReferences[0].Name = "node-2"

	t.Run("restart", func(t *testing.T) {
		hostProc := t.TempDir()
		fakeSandbox(t, hostProc, 100, victimUID, netnsWith(t, "10.1.8.8").NS.Path())
		fakeSandbox(t, hostProc, 101, staticUID, netnsWith(t, "10.1.8.8").NS.Path())
		h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }),
			withObjects(namespace("app", true), namespace("plain", false), victim, notOwned, stealsAPIUID, otherNode))
		for _, p := range []*corev1.Pod{notOwned, stealsAPIUID, otherNode} {
			if e, ok := h.reg.Get(string(p.UID)); ok && e.Netns != nil {
				t.Errorf("%s: restored with the netns of the uid it claims (%s)", p.Name, e.Netns)
			}
		}
	})
	t.Run("cni add", func(t *testing.T) {
		h := newHarness(t, withObjects(namespace("app", true), notOwned, otherNode))
		h.zt.connect()
		for _, p := range []*corev1.Pod{notOwned, otherNode} {
			ev := h.event(p)
			ev.UID = p.Annotations[podmeta.AnnotationConfigMirror]
			if out, err := h.cni.HandleAdd(t.Context(), ev); !errors.Is(err, ErrPodUnknown) {
				t.Errorf("%s: ADD with the uid it claims = %v, %v; want ErrPodUnknown", p.Name, out, err)
			}
			if h.zt.added(string(p.UID)) != 0 {
				t.Errorf("%s: Added to ztunnel on its claim", p.Name)
			}
		}
	})
}

// TestRuntimeUID is the rule, as a table.
func TestRuntimeUID(t *testing.T) {
	yes, no := true, false
	owner := func(kind, name string, controller *bool) []metav1.OwnerReference {
		return []metav1.OwnerReference{{APIVersion: "v1", Kind: kind, Name: name, Controller: controller}}
	}
	for _, c := range []struct {
		name   string
		mut    func(*corev1.Pod)
		static bool
	}{
		{"mirror pod", func(*corev1.Pod) {}, true},
		{"no annotation", func(p *corev1.Pod) { delete(p.Annotations, podmeta.AnnotationConfigMirror) }, false},
		{"empty annotation", func(p *corev1.Pod) { p.Annotations[podmeta.AnnotationConfigMirror] = "" }, false},
		{"not owned", func(p *corev1.Pod) { p.OwnerReferences = nil }, false},
		{"owned by another node", func(p *corev1.Pod) { p.OwnerReferences = owner("Node", "node-2", &yes) }, false},
		{"owner not controller", func(p *corev1.Pod) { p.OwnerReferences = owner("Node", node, &no) }, false},
		{"owned by a ReplicaSet", func(p *corev1.Pod) { p.OwnerReferences = owner("ReplicaSet", node, &yes) }, false},
		{"bound to another node", func(p *corev1.Pod) { p.Spec.NodeName = "node-2" }, false},
		{"claim not a uid", func(p *corev1.Pod) { p.Annotations[podmeta.AnnotationConfigMirror] = "../x" }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := mirrorPod("app", "a")
			c.mut(p)
			got, ok := podmeta.StaticUID(p, node)
			if ok != c.static || (ok && got != staticUID) {
				t.Errorf("StaticUID = %q, %v; want static %v", got, ok, c.static)
			}
		})
	}
}
