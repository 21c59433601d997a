package kube_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestEventSinkAggregates: client-go's recorder over EventSink writes an
// Event about a pod in the pod's namespace, then the same Event again as a
// patch of that one (count 2), not a second object; an Event about a node
// goes to the default namespace.
func TestEventSinkAggregates(t *testing.T) {
	cs := fake.NewClientset()
	b := record.NewBroadcaster()
	b.StartRecordingToSink(kube.EventSink{Client: kubetest.Wrap(cs).CoreV1()})
	defer b.Shutdown()
	rec := b.NewRecorder(kube.NewScheme(), corev1.EventSource{Component: "ambientd", Host: "n1"})

	events := func(ns string) []corev1.Event {
		l, err := cs.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return l.Items
	}
	podRef := &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: "app", Name: "web", UID: "u1"}
	rec.Event(podRef, corev1.EventTypeWarning, "EnrollmentPending", "ztunnel not connected")
	testutil.Eventually(t, "the pod's Event", 10*time.Second, func() bool { return len(events("app")) == 1 })
	rec.Event(podRef, corev1.EventTypeWarning, "EnrollmentPending", "ztunnel not connected")
	testutil.Eventually(t, "the pod's Event counted twice", 10*time.Second, func() bool {
		evs := events("app")
		return len(evs) == 1 && evs[0].Count == 2
	})
	var patched bool
	for _, a := range cs.Actions() {
		if a.GetVerb() == "patch" && a.GetResource().Resource == "events" && a.GetNamespace() == "app" {
			patched = true
		}
	}
	if !patched {
		t.Errorf("the repeated Event was not a patch in namespace app: %v", cs.Actions())
	}
	if evs := events("app"); evs[0].InvolvedObject.UID != "u1" || evs[0].Source.Host != "n1" {
		t.Errorf("Event %+v: want it about pod uid u1 from host n1", evs[0])
	}

	rec.Event(&corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: "n1", UID: "n"}, corev1.EventTypeNormal, "AmbientReady", "ready")
	testutil.Eventually(t, "the node's Event in the default namespace", 10*time.Second, func() bool {
		return len(events(metav1.NamespaceDefault)) == 1
	})
}
