package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// The condition's truth at the edges: what the agent must never publish or
// trust, whatever the API or a pod says.

// conditionWrites records, per pod, the condition of every pods/status
// patch the fake API received, with when it arrived.
type conditionWrites struct {
	mu   sync.Mutex
	seen map[string][]writtenCondition
}

type writtenCondition struct {
	at             time.Time
	status, reason string
}

func (c *conditionWrites) reactor() harnessOption {
	return withReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		pa, ok := a.(k8stesting.PatchAction)
		if !ok || pa.GetSubresource() != "status" {
			return false, nil, nil
		}
		var st writtenCondition
		st.at = time.Now()
		if s, r, ok := patchCondition(pa.GetPatch()); ok {
			st.status, st.reason = s, r
		}
		c.mu.Lock()
		c.seen[pa.GetName()] = append(c.seen[pa.GetName()], st)
		c.mu.Unlock()
		return false, nil, nil
	})
}

func (c *conditionWrites) of(name string) []writtenCondition {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]writtenCondition(nil), c.seen[name]...)
}

// TestDecideErrorNeverPublishesNotInMesh: a gated pod whose namespace the
// agent cannot read (the API fails the lookup) is not known to be out of
// the mesh: no True/NotInMesh is written for it — it would make a pod that
// belongs in the mesh Ready with nothing capturing it. Once the lookup works
// (the namespace is not in the mesh) the pod gets its True/NotInMesh.
func TestDecideErrorNeverPublishesNotInMesh(t *testing.T) {
	var failing atomic.Bool
	var lookups atomic.Int32
	failing.Store(true)
	nsFails := withReactor("get", "namespaces", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.GetAction).GetName() != "shop" || !failing.Load() {
			return false, nil, nil
		}
		lookups.Add(1)
		return true, nil, apierrors.NewInternalError(errors.New("etcdserver: request timed out"))
	})
	writes := &conditionWrites{seen: map[string][]writtenCondition{}}
	p := runningPod(pod("shop", "web", "uid-web", nil), "10.1.0.5")
	p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podmeta.ConditionEnrolled}}
	h := newHarness(t, nsFails, writes.reactor(), withObjects(p))
	h.zt.connect()
	// The informer's sync of the pod fails and is retried with backoff.
	h.waitFor("the namespace lookup failed three times", func() bool { return lookups.Load() >= 3 })
	// A CNI ADD of it (a new sandbox) fails the same way.
	if _, err := h.cni.HandleAdd(context.Background(), h.event(p)); err == nil {
		t.Error("CNI ADD of a pod whose namespace cannot be read succeeded")
	}

	fixed := time.Now()
	failing.Store(false)
	if _, err := h.client.CoreV1().Namespaces().Create(context.Background(), namespace("shop", false), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("True/NotInMesh once the namespace is read", func() bool {
		return h.conditionIs("shop", "web", corev1.ConditionTrue, ReasonNotInMesh)
	})
	for _, w := range writes.of("web") {
		if w.at.Before(fixed) {
			t.Errorf("condition %s/%s written while the pod's namespace could not be read", w.status, w.reason)
		}
	}
}

// TestRestartNeverTrustsSelfAnnotatedPod: a pod outside the mesh that
// annotates itself `ambient.istio.io/redirection: enabled` (any pod may set
// its own annotations at creation) is not registered at a restart: it is
// not in the first ztunnel snapshot (its netns would be handed to ztunnel),
// its rules are neither read nor written, and its sync takes the claim off.
func TestRestartNeverTrustsSelfAnnotatedPod(t *testing.T) {
	hostProc := t.TempDir()
	podNS := testutil.NewNetNS(t)
	liar := runningPod(pod("plain", "liar", "uid-liar", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "127.0.0.1")
	liar.Status.Conditions = []corev1.PodCondition{{Type: podmeta.ConditionEnrolled, Status: corev1.ConditionTrue, Reason: ReasonEnrolled}}
	member := runningPod(pod("app", "member", "uid-member", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "127.0.0.1")
	fakeSandbox(t, hostProc, 100, "uid-liar", podNS.NS.Path())
	fakeSandbox(t, hostProc, 101, "uid-member", podNS.NS.Path())
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), namespace("plain", false), liar, member))
	for _, e := range h.firstSnapshot() {
		if e.Workload.UID == "uid-liar" {
			t.Errorf("a pod outside the mesh is in ztunnel's first snapshot (netns handed over: %v) on its own annotation", e.Netns != nil)
		}
	}
	if st := h.state("uid-liar"); st != "absent" {
		t.Errorf("self-annotated pod outside the mesh restored as %s, want absent", st)
	}
	h.rules.mu.Lock()
	verified := h.rules.verified
	h.rules.mu.Unlock()
	if verified != 1 {
		t.Errorf("rules read back in %d pods, want 1 (the member only)", verified)
	}
	h.waitFor("the claim taken off the pod", func() bool {
		_, has := h.annotation("plain", "liar")
		return !has && h.conditionIs("plain", "liar", corev1.ConditionTrue, ReasonNotInMesh)
	})
	h.zt.connect()
	h.waitFor("the member enabled", func() bool { return h.state("uid-member") == "enabled" })
	if n := h.zt.tried("uid-liar"); n != 0 {
		t.Errorf("the self-annotated pod was Added to ztunnel %d times", n)
	}
}

// TestHandOverKeepsTheOptionsRulesWereBuiltWith: a KubeVirt pod enrolled
// with reroute-virtual-interfaces whose dns-capture annotation later turns
// invalid keeps its options (enrolled pods keep what they were enrolled
// with); a handover to Istio's agent moves its rules with those options —
// not the node's defaults, which would drop the reroute and leave the VM's
// traffic uncaptured under Istio.
func TestHandOverKeepsTheOptionsRulesWereBuiltWith(t *testing.T) {
	to := &fakeSuccessor{}
	vm := pod("app", "vm", "uid-vm", map[string]string{podmeta.AnnotationRerouteVirtualInterfaces: "tap0", podmeta.AnnotationDNSCapture: "false"})
	h := newHarness(t, withConfig(func(c *Config) {
		c.DNSCapture = true
		c.HandOver = func(context.Context) (SuccessorRules, error) { return to, nil }
	}), withObjects(namespace("app", true), vm))
	h.enrollConnected(vm)
	vm, err := h.client.CoreV1().Pods("app").Get(context.Background(), "vm", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vm.Annotations[podmeta.AnnotationDNSCapture] = "no" // invalid: ignored, the pod keeps false
	if _, err := h.client.CoreV1().Pods("app").Update(context.Background(), vm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the invalid value seen", func() bool { return h.hasEvent("app", EventInvalidAnnotation, "ambient.istio.io/dns-capture") })
	h.stop()
	moved := to.moved()
	want := iptables.PodOptions{DNSCapture: false, RerouteInterfaces: "tap0"}
	if len(moved) != 1 || moved[0] != want {
		t.Errorf("handover moved the rules with %+v, want %+v (what they were built with)", moved, want)
	}
}

// TestHandOverReleasesGatedPodsFalse: Istio's agent never writes the
// agent's condition, so a gated pod whose condition is False at a handover
// would stay NotReady for ever under it. The handover sets every such pod
// True/HandedOver (annotation kept); True pods are left as they are.
func TestHandOverReleasesGatedPodsFalse(t *testing.T) {
	gate := []corev1.PodReadinessGate{{ConditionType: podmeta.ConditionEnrolled}}
	on := pod("app", "on", "uid-on", nil)
	on.Spec.ReadinessGates = gate
	h := handOverWithHeldPod(t, &fakeSuccessor{}, on)
	if !h.conditionIs("app", "held", corev1.ConditionTrue, ReasonHandedOver) {
		t.Errorf("gated pod False at the handover: condition %+v afterwards, want True/%s", h.condition("app", "held"), ReasonHandedOver)
	}
	if v, _ := h.annotation("app", "held"); v != podmeta.RedirectionPending {
		t.Errorf("annotation %q after the handover, want it kept (pending): Istio's agent reads it", v)
	}
	if !h.conditionIs("app", "on", corev1.ConditionTrue, ReasonEnrolled) {
		t.Errorf("enrolled pod's condition %+v after the handover, want True/Enrolled kept", h.condition("app", "on"))
	}
}

// handOverWithHeldPod runs an agent that hands the node over to to, with a
// gated pod app/held that ztunnel refused (False/ZtunnelRejected, its rules
// in place) and the enrolled pods enrolled, and stops it: the handover has
// run when it returns.
func handOverWithHeldPod(t *testing.T, to *fakeSuccessor, enrolled ...*corev1.Pod) *harness {
	t.Helper()
	return stopWithHeldPod(t, func(c *Config) { c.HandOver = func(context.Context) (SuccessorRules, error) { return to, nil } }, nil, enrolled...)
}

// stopWithHeldPod is handOverWithHeldPod with the stop's settings in cfg;
// beforeStop, when set, runs just before the agent is stopped.
func stopWithHeldPod(t *testing.T, cfg func(*Config), beforeStop func(*harness), enrolled ...*corev1.Pod) *harness {
	t.Helper()
	held := pod("app", "held", "uid-held", nil)
	held.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podmeta.ConditionEnrolled}}
	objs := []runtime.Object{namespace("app", true), held}
	for _, p := range enrolled {
		objs = append(objs, p)
	}
	h := newHarness(t, withConfig(cfg), withObjects(objs...))
	h.zt.connect()
	for _, p := range enrolled {
		h.enrollConnected(p)
	}
	h.zt.setNack("uid-held", "not now")
	if _, err := h.cni.HandleAdd(context.Background(), h.event(held)); err != nil {
		t.Fatalf("HandleAdd: %v", err)
	}
	h.waitFor("held pod False/ZtunnelRejected", func() bool {
		return h.conditionIs("app", "held", corev1.ConditionFalse, ReasonZtunnelRejected)
	})
	if beforeStop != nil {
		beforeStop(h)
	}
	h.stop()
	return h
}

// TestHandOverNeverTrueOnAFailedMove: a False pod whose rules could not be
// moved into the successor's backend is not handed over: its capture under
// the successor is not known, so it gets False/NotHandedOver, never True.
func TestHandOverNeverTrueOnAFailedMove(t *testing.T) {
	h := handOverWithHeldPod(t, &fakeSuccessor{fails: true})
	if !h.conditionIs("app", "held", corev1.ConditionFalse, ReasonNotHandedOver) {
		t.Errorf("pod whose rules were not moved: condition %+v after the handover, want False/%s", h.condition("app", "held"), ReasonNotHandedOver)
	}
}

// TestHandOverNeverTrueWhenRulesDoNotReadBack: a move the successor's
// backend reported done, but whose rules do not read back as written
// (a rule missing), is not a handover: the pod gets False/NotHandedOver,
// never a True that would make it Ready with its traffic not captured.
func TestHandOverNeverTrueWhenRulesDoNotReadBack(t *testing.T) {
	h := handOverWithHeldPod(t, &fakeSuccessor{drift: true})
	if !h.conditionIs("app", "held", corev1.ConditionFalse, ReasonNotHandedOver) {
		t.Errorf("pod whose rules did not read back: condition %+v after the handover, want False/%s", h.condition("app", "held"), ReasonNotHandedOver)
	}
}

// TestUninstallWithoutSuccessorReleasesGatedPods: ambientd uninstalled
// with no node agent after it (--handover none) would leave a gated pod
// whose condition is False NotReady for ever, its rules sending its
// traffic to a ztunnel that does not carry it. It is released: rules
// removed, True/Uninstalled, annotation removed. An enrolled pod (True)
// keeps its rules and condition; an upgrade (not an uninstall) releases
// nothing.
func TestUninstallWithoutSuccessorReleasesGatedPods(t *testing.T) {
	for _, uninstall := range []bool{true, false} {
		t.Run(fmt.Sprintf("uninstall=%v", uninstall), func(t *testing.T) {
			on := pod("app", "on", "uid-on", nil)
			on.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podmeta.ConditionEnrolled}}
			h := stopWithHeldPod(t, func(c *Config) { c.Uninstalling = func(context.Context) bool { return uninstall } }, nil, on)
			_, deleted, _ := h.rules.counts()
			if !uninstall {
				if !h.conditionIs("app", "held", corev1.ConditionFalse, ReasonZtunnelRejected) || deleted != 0 {
					t.Errorf("an upgrade changed the held pod: condition %+v, %d rule sets deleted", h.condition("app", "held"), deleted)
				}
				return
			}
			if !h.conditionIs("app", "held", corev1.ConditionTrue, ReasonUninstalled) {
				t.Errorf("gated pod False at the uninstall: condition %+v afterwards, want True/%s", h.condition("app", "held"), ReasonUninstalled)
			}
			if v, ok := h.annotation("app", "held"); ok {
				t.Errorf("annotation %q left on a released pod, want it removed", v)
			}
			if deleted != 1 {
				t.Errorf("%d pods' rules removed, want the held pod's only", deleted)
			}
			if !h.conditionIs("app", "on", corev1.ConditionTrue, ReasonEnrolled) {
				t.Errorf("enrolled pod's condition %+v after the uninstall, want True/Enrolled kept", h.condition("app", "on"))
			}
		})
	}
}

// TestUninstallNeverTrueWhenRulesStay: a False pod whose rules cannot be
// removed at the uninstall is not released: False/NotReleased.
func TestUninstallNeverTrueWhenRulesStay(t *testing.T) {
	h := stopWithHeldPod(t, func(c *Config) { c.Uninstalling = func(context.Context) bool { return true } }, func(h *harness) {
		h.rules.mu.Lock()
		h.rules.deleteFails = 1
		h.rules.mu.Unlock()
	})
	if !h.conditionIs("app", "held", corev1.ConditionFalse, ReasonNotReleased) {
		t.Errorf("pod whose rules stayed: condition %+v after the uninstall, want False/%s", h.condition("app", "held"), ReasonNotReleased)
	}
}

// patchCondition reads the condition's status and reason from a pods/status
// patch body (podstatus's strategic merge patch).
func patchCondition(body []byte) (status, reason string, ok bool) {
	var p struct {
		Status struct {
			Conditions []struct{ Status, Reason string } `json:"conditions"`
		} `json:"status"`
	}
	if json.Unmarshal(body, &p) != nil || len(p.Status.Conditions) == 0 {
		return "", "", false
	}
	return p.Status.Conditions[0].Status, p.Status.Conditions[0].Reason, true
}
