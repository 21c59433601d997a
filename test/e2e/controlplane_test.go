//go:build e2e

package e2e

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestControlPlaneIsReal proves the apiserver is a real one, with the
// behaviour the agent relies on: labels on namespaces, pods bound to a node,
// annotations patched through pods/status, watches filtered by spec.nodeName,
// and RBAC from deploy/rbac.yaml enforced on the agent's token.
func TestControlPlaneIsReal(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	admin, agent := testEnv.CP.Admin, testEnv.CP.Agent
	const annotation = "ambient.istio.io/redirection"

	// A labelled namespace, read back through the agent's identity.
	nsName := "cp-" + fmt.Sprint(time.Now().UnixNano()%1e6)
	if _, err := testEnv.CreateNamespace(ctx, nsName, map[string]string{"istio.io/dataplane-mode": "ambient"}); err != nil {
		t.Fatal(err)
	}
	got, err := agent.CoreV1().Namespaces().Get(ctx, nsName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("agent get namespace: %v", err)
	}
	if got.Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Fatalf("namespace labels = %v, want istio.io/dataplane-mode=ambient", got.Labels)
	}

	// The agent watches only pods on its node.
	sel := fields.OneTermEqualSelector("spec.nodeName", testEnv.NodeName).String()
	w, err := agent.CoreV1().Pods(metav1.NamespaceAll).Watch(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		t.Fatalf("agent watch pods with %s: %v", sel, err)
	}
	defer w.Stop()

	mkPod := func(name, node string) *corev1.Pod {
		p, err := admin.CoreV1().Pods(nsName).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": name}},
			Spec: corev1.PodSpec{
				NodeName:           node,
				ServiceAccountName: "default",
				Containers:         []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod %s: %v", name, err)
		}
		return p
	}
	other := mkPod("elsewhere", "some-other-node")
	mine := mkPod("here", testEnv.NodeName)
	if mine.Spec.NodeName != testEnv.NodeName {
		t.Fatalf("spec.nodeName = %q", mine.Spec.NodeName)
	}

	// The harness plays kubelet: Running with an IP, through pods/status.
	running, err := testEnv.MarkRunning(ctx, mine, []netip.Addr{netip.MustParseAddr("10.99.0.7")})
	if err != nil {
		t.Fatal(err)
	}
	if running.Status.Phase != corev1.PodRunning || running.Status.PodIP != "10.99.0.7" {
		t.Fatalf("status after MarkRunning: phase %s podIP %s", running.Status.Phase, running.Status.PodIP)
	}

	// What the agent does: a merge patch of the annotation on pods/status.
	patch := []byte(`{"metadata":{"annotations":{"` + annotation + `":"enabled"}}}`)
	if _, err := agent.CoreV1().Pods(nsName).Patch(ctx, mine.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		t.Fatalf("agent patch pods/status annotation: %v", err)
	}
	after, err := admin.CoreV1().Pods(nsName).Get(ctx, mine.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if after.Annotations[annotation] != "enabled" {
		t.Fatalf("annotations after pods/status patch = %v", after.Annotations)
	}

	// The watch delivers our pod's add and the annotation change, and
	// nothing of the pod on the other node.
	sawAdd, sawAnnotation := false, false
	timeout := time.After(time.Minute)
	for !sawAdd || !sawAnnotation {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatal("watch closed early")
			}
			p, isPod := ev.Object.(*corev1.Pod)
			if !isPod {
				t.Fatalf("watch event %s with %T", ev.Type, ev.Object)
			}
			if p.UID == other.UID {
				t.Fatalf("field-selected watch delivered pod on node %q", p.Spec.NodeName)
			}
			if p.UID != mine.UID {
				continue
			}
			sawAdd = sawAdd || ev.Type == watch.Added
			sawAnnotation = sawAnnotation || (ev.Type == watch.Modified && p.Annotations[annotation] == "enabled")
		case <-timeout:
			t.Fatalf("watch: added=%v annotated=%v after 1m", sawAdd, sawAnnotation)
		}
	}

	// RBAC: allowed where deploy/rbac.yaml allows, refused elsewhere.
	if _, err := agent.CoreV1().Nodes().Patch(ctx, testEnv.NodeName, types.MergePatchType, []byte(`{"metadata":{"labels":{"e2e/touched":"yes"}}}`), metav1.PatchOptions{}); err != nil {
		t.Errorf("agent patch node: %v (deploy/rbac.yaml allows it)", err)
	}
	if _, err := agent.CoreV1().Events(nsName).Create(ctx, &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: "ambientd-"},
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: nsName, Name: mine.Name, UID: mine.UID},
		Reason:         "E2E", Message: "rbac check", Type: corev1.EventTypeNormal,
	}, metav1.CreateOptions{}); err != nil {
		t.Errorf("agent create event: %v (deploy/rbac.yaml allows it)", err)
	}
	refused := map[string]error{}
	_, refused["create pods"] = agent.CoreV1().Pods(nsName).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "not-allowed"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}},
	}, metav1.CreateOptions{})
	refused["delete pods"] = agent.CoreV1().Pods(nsName).Delete(ctx, mine.Name, metav1.DeleteOptions{})
	_, refused["list secrets"] = agent.CoreV1().Secrets(nsName).List(ctx, metav1.ListOptions{})
	_, refused["patch namespaces"] = agent.CoreV1().Namespaces().Patch(ctx, nsName, types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
	_, refused["update pods"] = agent.CoreV1().Pods(nsName).Update(ctx, after, metav1.UpdateOptions{})
	refused["delete nodes"] = agent.CoreV1().Nodes().Delete(ctx, testEnv.NodeName, metav1.DeleteOptions{})
	for what, err := range refused {
		if !apierrors.IsForbidden(err) {
			t.Errorf("agent %s: got %v, want 403 Forbidden", what, err)
		}
	}
	// The refusal is RBAC's, for the agent's service account user.
	if err := refused["list secrets"]; err != nil && !strings.Contains(err.Error(), e2eenv.AgentUser) {
		t.Errorf("forbidden message does not name %s: %v", e2eenv.AgentUser, err)
	}

	_ = admin.CoreV1().Pods(nsName).Delete(ctx, other.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	_ = admin.CoreV1().Pods(nsName).Delete(ctx, mine.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
}
