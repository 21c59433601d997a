package agent

import (
	"maps"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/podmeta"
)

// reconcileEvents reads Istio's nodeagent_reconcile_events_total by type.
func (h *harness) reconcileEvents() map[string]float64 {
	h.t.Helper()
	mfs, err := h.agent.Metrics().Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != istiometrics.ReconcileEventsName {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "type" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return got
}

// TestIstioReconcileEvents: every pod (this node's) and namespace event the
// informers deliver counts once under Istio's name, by its type — a
// namespace update that changes no label the agent acts on too, as Istio's
// agent reconciles every namespace event.
func TestIstioReconcileEvents(t *testing.T) {
	h := newHarness(t, withObjects(namespace("plain", false), pod("plain", "web", "uid-web", nil)))
	initial := map[string]float64{"add": 2, "update": 0, "delete": 0} // the namespace and the pod, listed at start
	h.waitFor("the initial list counted", func() bool { return maps.Equal(h.reconcileEvents(), initial) })

	ctx := h.t.Context()
	ns, err := h.client.CoreV1().Namespaces().Create(ctx, namespace("other", false), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns.Annotations = map[string]string{"team": "a"} // no label the agent reads
	if _, err := h.client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := h.client.CoreV1().Pods("plain").Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Labels = map[string]string{"app": "web"}
	if _, err := h.client.CoreV1().Pods("plain").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := h.client.CoreV1().Pods("plain").Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := h.client.CoreV1().Namespaces().Delete(ctx, "other", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"add": 3, "update": 2, "delete": 2}
	h.waitFor("each event counted once by type", func() bool { return maps.Equal(h.reconcileEvents(), want) })
}

// TestFirstTrue: only a write that turns a never-carried pod's condition
// True/Enrolled is a pod's first mesh-ready moment.
func TestFirstTrue(t *testing.T) {
	enrolled := podstatus.Status{Redirection: podmeta.RedirectionEnabled, Condition: podstatus.Condition{Status: corev1.ConditionTrue, Reason: ReasonEnrolled}}
	tests := []struct {
		name      string
		cur, want podstatus.Status
		first     bool
	}{
		{"a new pod (shows nothing)", podstatus.Status{}, enrolled, true},
		{"pending, then carried", podstatus.Status{Redirection: podmeta.RedirectionPending, Condition: podstatus.Condition{Status: corev1.ConditionFalse, Reason: ReasonPending}}, enrolled, true},
		{"no ztunnel at its ADD, then carried", podstatus.Status{Redirection: podmeta.RedirectionPending, Condition: podstatus.Condition{Status: corev1.ConditionFalse, Reason: ReasonZtunnelUnavailable}}, enrolled, true},
		{"served again after its ztunnel went (Unserved keeps enabled)", podstatus.Status{Redirection: podmeta.RedirectionEnabled, Condition: podstatus.Condition{Status: corev1.ConditionFalse, Reason: ReasonZtunnelUnavailable}}, enrolled, false},
		{"already True/Enrolled (a heal)", podstatus.Status{Redirection: podmeta.RedirectionEnabled, Condition: podstatus.Condition{Status: corev1.ConditionTrue, Reason: ReasonEnrolled, Message: "old"}}, enrolled, false},
		{"labelled into the mesh while True/NotInMesh", podstatus.Status{Condition: podstatus.Condition{Status: corev1.ConditionTrue, Reason: ReasonNotInMesh}}, enrolled, false},
		{"True/NotInMesh is not mesh-ready", podstatus.Status{}, podstatus.Status{Condition: podstatus.Condition{Status: corev1.ConditionTrue, Reason: ReasonNotInMesh}}, false},
		{"a False write", podstatus.Status{}, podstatus.Status{Redirection: podmeta.RedirectionPending, Condition: podstatus.Condition{Status: corev1.ConditionFalse, Reason: ReasonPending}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := firstTrue(tt.cur, tt.want); got != tt.first {
				t.Errorf("firstTrue = %v, want %v", got, tt.first)
			}
		})
	}
}

// TestPodMeshReadyObserved: a pod created 3 s ago that ztunnel could not
// take at its ADD is observed once, when its condition lands True/Enrolled,
// with its age then.
func TestPodMeshReadyObserved(t *testing.T) {
	p := pod("app", "web", "uid-web", nil)
	p.CreationTimestamp = metav1.NewTime(time.Now().Add(-3 * time.Second))
	h := newHarness(t, withObjects(namespace("app", true), p))
	observed := func() (uint64, float64) {
		var m dto.Metric
		if err := h.agent.metrics.podMeshReady.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
	}
	if out, err := h.cni.HandleAdd(h.t.Context(), h.event(p)); err != nil || out != Pending {
		t.Fatalf("HandleAdd with no ztunnel = %v, %v; want pending", out, err)
	}
	h.waitFor("condition False/ZtunnelUnavailable", func() bool {
		return h.conditionIs("app", "web", corev1.ConditionFalse, ReasonZtunnelUnavailable)
	})
	if n, _ := observed(); n != 0 {
		t.Fatalf("%d observations while the pod waits for ztunnel, want 0", n)
	}
	start := time.Now()
	h.zt.connect()
	h.waitFor("condition True/Enrolled", func() bool { return h.conditionIs("app", "web", corev1.ConditionTrue, ReasonEnrolled) })
	h.waitFor("an observation", func() bool { n, _ := observed(); return n >= 1 })
	if n, _ := observed(); n != 1 {
		t.Fatalf("%d observations of one pod's first enrollment, want 1", n)
	}
	if _, sum := observed(); sum < 3 || sum > 3+time.Since(start).Seconds()+5 {
		t.Errorf("observed %.2fs, want the pod's age when it was enrolled (3 s and a little)", sum)
	}
}
