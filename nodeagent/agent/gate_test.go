package agent

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
)

// TestGatedPodNotEnrolledGetsNotInMesh: the no-deadlock rule. Pods gated on
// the condition that the agent does not enroll (opted out after admission,
// gated by hand outside the mesh, sidecar-injected) get True/NotInMesh, both
// from the informer and from their CNI ADD; an ungated pod outside the mesh
// and a gated terminal pod get nothing.
func TestGatedPodNotEnrolledGetsNotInMesh(t *testing.T) {
	withGate := func(p *corev1.Pod) *corev1.Pod {
		p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: "example.com/other"}, {ConditionType: podmeta.ConditionEnrolled}}
		return p
	}
	optedOut := withGate(runningPod(pod("app", "opted-out", "uid-1", nil), "10.1.0.5"))
	optedOut.Labels = map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeNone}
	plain := withGate(runningPod(pod("plain", "by-hand", "uid-2", nil), "10.1.0.6"))
	sidecar := withGate(runningPod(pod("app", "sidecar", "uid-3", map[string]string{podmeta.AnnotationSidecarStatus: "{}"}), "10.1.0.7"))
	ungated := runningPod(pod("plain", "ungated", "uid-4", nil), "10.1.0.8")
	done := withGate(pod("plain", "done", "uid-5", nil))
	done.Status.Phase = corev1.PodSucceeded
	h := newHarness(t, withObjects(namespace("app", true), namespace("plain", false), optedOut, plain, sidecar, ungated, done))
	h.zt.connect()
	for _, p := range []*corev1.Pod{optedOut, plain, sidecar} {
		h.waitFor(p.Name+": True/NotInMesh", func() bool {
			c := h.condition(p.Namespace, p.Name)
			return c != nil && c.Status == corev1.ConditionTrue && c.Reason == ReasonNotInMesh
		})
		if v, has := h.annotation(p.Namespace, p.Name); has {
			t.Errorf("%s: annotation %q on a pod never enrolled", p.Name, v)
		}
	}
	// A CNI ADD of a gated pod out of the mesh (new sandbox) ends the same.
	late := withGate(pod("plain", "late", "uid-7", nil))
	if _, err := h.client.CoreV1().Pods("plain").Create(t.Context(), late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if out, err := h.cni.HandleAdd(t.Context(), h.event(late)); err != nil || out != NotInMesh {
		t.Fatalf("HandleAdd = %v, %v; want NotInMesh", out, err)
	}
	h.waitFor("late: True/NotInMesh", func() bool {
		c := h.condition("plain", "late")
		return c != nil && c.Status == corev1.ConditionTrue && c.Reason == ReasonNotInMesh
	})
	// By now every pod above was synced (the workqueue is FIFO): nothing
	// was written to the others.
	for _, p := range []*corev1.Pod{ungated, done} {
		if c := h.condition(p.Namespace, p.Name); c != nil {
			t.Errorf("%s: condition %+v written", p.Name, c)
		}
	}
}
