package agent

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/podmeta"
)

// TestPodsMissingTheGateAreReported: a pod the agent enrolls that admission
// would have gated but that has no gate (created while the webhook was
// down) gets one Warning Event ReadinessGateMissing, is counted by
// ambientd_pods_missing_readiness_gate and marked in `ambientd status`; a
// gated pod, an opted-out pod or namespace, and a pod out of the mesh are
// not.
func TestPodsMissingTheGateAreReported(t *testing.T) {
	gated := pod("app", "gated", "uid-1", nil)
	gated.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podmeta.ConditionEnrolled}}
	missing := pod("app", "missing", "uid-2", nil)
	optedOut := pod("app", "opted-out", "uid-3", nil)
	optedOut.Labels = map[string]string{admission.LabelReadinessGate: admission.OptOutValue}
	plain := pod("plain", "plain", "uid-4", nil)
	quietNS := namespace("quiet", true)
	quietNS.Labels[admission.LabelReadinessGate] = admission.OptOutValue
	quiet := pod("quiet", "in-quiet", "uid-5", nil)
	h := newHarness(t, withObjects(namespace("app", true), namespace("plain", false), quietNS, gated, optedOut, plain, quiet, missing))
	// Each pod starts through its CNI ADD, as the runtime starts it.
	for _, p := range []*corev1.Pod{gated, optedOut, quiet, missing} {
		h.enrollConnected(p)
	}
	if out, err := h.cni.HandleAdd(t.Context(), h.event(plain)); err != nil || out != NotInMesh {
		t.Fatalf("plain: HandleAdd = %v, %v", out, err)
	}
	h.waitFor("missing: Event ReadinessGateMissing", func() bool {
		return h.hasEvent("app", EventReadinessGateMissing, "no readiness gate "+podmeta.ConditionEnrolled)
	})
	// A pod enrolled now records its Event after every pod above (one
	// recorder, in order): once it is there, theirs would be too.
	late := pod("app", "late", "uid-6", nil)
	if _, err := h.client.CoreV1().Pods("app").Create(t.Context(), late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.enrollConnected(late)
	h.waitFor("late: Event ReadinessGateMissing", func() bool { return countEvents(h, "app", EventReadinessGateMissing) == 2 })
	for _, ns := range []string{"plain", "quiet"} {
		if h.hasEvent(ns, EventReadinessGateMissing, "") {
			t.Errorf("Event ReadinessGateMissing in namespace %s", ns)
		}
	}
	if evs := countEvents(h, "app", EventReadinessGateMissing); evs != 2 {
		t.Errorf("%d ReadinessGateMissing Events in app, want 2 (missing, late)", evs)
	}
	// Running (kubelet's status): now they could be Ready.
	for _, p := range []*corev1.Pod{gated, optedOut, plain, quiet, missing, late} {
		o, err := h.client.CoreV1().Pods(p.Namespace).Get(t.Context(), p.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		o.Status.Phase = corev1.PodRunning
		if _, err := h.client.CoreV1().Pods(p.Namespace).UpdateStatus(t.Context(), o, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	h.waitFor("the cache sees them running", func() bool {
		for _, p := range []*corev1.Pod{gated, optedOut, plain, quiet, missing, late} {
			if c := h.agent.podByUID(string(p.UID)); c == nil || c.Status.Phase != corev1.PodRunning {
				return false
			}
		}
		return true
	})
	// Synced again once they show True (a resync, a restart's
	// verification): no second Event. A last pod's Event, recorded after
	// those syncs, proves none came.
	for _, uid := range []string{"uid-2", "uid-6"} {
		h.waitFor(uid+" shows True", func() bool {
			c := h.agent.podByUID(uid)
			return c != nil && podCondition(c, podmeta.ConditionEnrolled) != nil && podCondition(c, podmeta.ConditionEnrolled).Status == corev1.ConditionTrue
		})
		if _, err := h.agent.sync(t.Context(), uid, nil); err != nil {
			t.Fatal(err)
		}
	}
	last := pod("app", "last", "uid-7", nil)
	if _, err := h.client.CoreV1().Pods("app").Create(t.Context(), last, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.enrollConnected(last)
	h.waitFor("last: Event ReadinessGateMissing", func() bool {
		evs, _ := h.client.CoreV1().Events("app").List(t.Context(), metav1.ListOptions{})
		for _, e := range evs.Items {
			if e.InvolvedObject.Name == "last" {
				return true
			}
		}
		return false
	})
	if evs := countEvents(h, "app", EventReadinessGateMissing); evs != 3 {
		t.Errorf("%d ReadinessGateMissing Events in app after the re-syncs, want 3 (missing, late, last)", evs)
	}
	mfs, err := h.agent.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var got float64 = -1
	for _, mf := range mfs {
		if mf.GetName() == "ambientd_pods_missing_readiness_gate" {
			got = mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if got != 2 {
		t.Errorf("ambientd_pods_missing_readiness_gate = %v, want 2", got)
	}
	for _, v := range h.agent.Pods() {
		if v.MissingGate != (v.Name == "missing" || v.Name == "late") {
			t.Errorf("status of %s/%s: missing gate %v", v.Namespace, v.Name, v.MissingGate)
		}
	}
}

func countEvents(h *harness, namespace, reason string) int {
	evs, err := h.client.CoreV1().Events(namespace).List(h.t.Context(), metav1.ListOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	n := 0
	for _, e := range evs.Items {
		if e.Reason == reason {
			n += max(int(e.Count), 1) // the recorder folds repeats into one Event's count
		}
	}
	return n
}

// TestMissingGateEventsOff: with --missing-gate-events=false (the chart's
// readinessGate.mechanism none: no admission adds the gate, on purpose) a
// mesh pod without the gate costs no Event.
func TestMissingGateEventsOff(t *testing.T) {
	missing := pod("app", "missing", "uid-1", nil)
	// Its invalid annotation's Event is recorded after the gate's would be
	// (one recorder, in order): once it is there, the other would be too.
	marker := pod("app", "marker", "uid-2", map[string]string{podmeta.AnnotationDNSCapture: "maybe"})
	marker.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podmeta.ConditionEnrolled}}
	h := newHarness(t, withConfig(func(c *Config) { c.MissingGateEvents = false }), withObjects(namespace("app", true), missing, marker))
	h.enrollConnected(missing)
	h.enrollConnected(marker)
	h.waitFor("the marker's InvalidAnnotation Event", func() bool { return h.hasEvent("app", EventInvalidAnnotation, "") })
	if n := countEvents(h, "app", EventReadinessGateMissing); n != 0 {
		t.Errorf("%d ReadinessGateMissing Events with --missing-gate-events=false", n)
	}
}
