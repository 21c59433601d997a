//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// repairPods creates, as the admin, the pods the repair rights are judged
// on: broken sidecar pods (istio-validation last exited 126) on mine and on
// other, a healthy sidecar pod and a broken pod without the sidecar
// annotation on mine.
func repairPods(t *testing.T, ctx context.Context, ns, mine, other string) map[string]*corev1.Pod {
	t.Helper()
	admin := testEnv.CP.Admin
	out := map[string]*corev1.Pod{}
	for _, p := range []struct {
		name, node     string
		sidecar, fails bool
	}{{"broken", mine, true, true}, {"broken-other-node", other, true, true}, {"healthy", mine, true, false}, {"no-sidecar", mine, false, true}} {
		obj := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Labels: map[string]string{"app": p.name}},
			Spec: corev1.PodSpec{NodeName: p.node, InitContainers: []corev1.Container{{Name: "istio-validation", Image: "v"}},
				Containers: []corev1.Container{{Name: "app", Image: "app:v1"}}},
		}
		if p.sidecar {
			obj.Annotations = map[string]string{annSidecar: "{}"}
		}
		created, err := admin.CoreV1().Pods(ns).Create(ctx, obj, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		st := corev1.ContainerStatus{Name: "istio-validation", Image: "v",
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}}
		if p.fails {
			st.LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Reason: "Error"}}
		}
		created.Status = corev1.PodStatus{Phase: corev1.PodPending, InitContainerStatuses: []corev1.ContainerStatus{st}}
		if created, err = admin.CoreV1().Pods(ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		out[p.name] = created
	}
	return out
}

// componentRightsSetup installs deploy/ with the component (none: "") and
// returns the agent's node-bound client, its node and the judged pods, once
// the policy is in force.
func componentRightsSetup(t *testing.T, ctx context.Context, component string) (kubernetes.Interface, string, map[string]*corev1.Pod) {
	t.Helper()
	extra := "namePrefix: e2e-repair-"
	if component != "" {
		extra += "\ncomponents:\n  - " + filepath.Join("$DEPLOY", "components", component)
	}
	inst := installDeploy(t, ctx, extra)
	mine := createTestNode(t, ctx, "repair-mine")
	other := createTestNode(t, ctx, "repair-other")
	ns := fmt.Sprintf("repair-%d", time.Now().UnixNano()%1e9)
	if _, err := testEnv.CreateNamespace(ctx, ns, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = testEnv.CP.Admin.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})
	pods := repairPods(t, ctx, ns, mine, other)
	c, err := kubernetes.NewForConfig(inst.token(t, ctx, mine))
	if err != nil {
		t.Fatal(err)
	}
	// The policy loads asynchronously: wait until it refuses annotating a
	// pod of the other node.
	var last error
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		_, last = c.CoreV1().Pods(ns).Patch(ctx, "broken-other-node", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"ambient.istio.io/redirection":"pending"}}}`), metav1.PatchOptions{}, "status")
		return isDenied(last), nil
	}); err != nil {
		t.Fatalf("admission policy never in force; last answer: %v", last)
	}
	return c, mine, pods
}

func labelPatch(key, value string) []byte {
	return []byte(fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, key, value))
}

// TestRepairComponentRights: the repair controller's delete and label
// modes get their writes only from the opt-in components, and only on a
// broken sidecar pod of the agent's own node (deploy/admission-policy.yaml),
// with the agent's node-bound token: with repair-delete it may delete such
// a pod and nothing else (a healthy sidecar pod, a broken pod of another
// node, a broken pod without the sidecar annotation); with repair-label it
// may add cni.istio.io/uninitialized=true to such a pod through pods/status
// and nothing else (another label, another value, another pod); without a
// component, neither.
func TestRepairComponentRights(t *testing.T) {
	ctx := testutil.Context(t, 6*time.Minute)
	const broken = "cni.istio.io/uninitialized"
	del := func(c kubernetes.Interface, p *corev1.Pod) error {
		// The pod as it is now (the policy probe may have written it).
		p, err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		uid, rv := p.UID, p.ResourceVersion
		return c.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv}})
	}
	label := func(c kubernetes.Interface, p *corev1.Pod, key, value string) error {
		_, err := c.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, labelPatch(key, value), metav1.PatchOptions{}, "status")
		return err
	}
	denied := func(t *testing.T, what string, err error) {
		t.Helper()
		// Refused by RBAC (no component) or by the admission policy.
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s: %v, want refused", what, err)
		}
	}

	t.Run("no component", func(t *testing.T) {
		c, _, pods := componentRightsSetup(t, ctx, "")
		denied(t, "delete a broken sidecar pod", del(c, pods["broken"]))
		denied(t, "label a broken sidecar pod", label(c, pods["broken"], broken, "true"))
	})
	t.Run("repair-delete", func(t *testing.T) {
		c, _, pods := componentRightsSetup(t, ctx, "repair-delete")
		denied(t, "delete a healthy sidecar pod", del(c, pods["healthy"]))
		denied(t, "delete a broken pod of another node", del(c, pods["broken-other-node"]))
		denied(t, "delete a broken pod without the sidecar annotation", del(c, pods["no-sidecar"]))
		denied(t, "label (not this component's)", label(c, pods["broken"], broken, "true"))
		if err := del(c, pods["broken"]); err != nil {
			t.Errorf("delete the broken sidecar pod of its node: %v", err)
		}
	})
	t.Run("repair-label", func(t *testing.T) {
		c, _, pods := componentRightsSetup(t, ctx, "repair-label")
		denied(t, "label a healthy sidecar pod", label(c, pods["healthy"], broken, "true"))
		denied(t, "label a broken pod of another node", label(c, pods["broken-other-node"], broken, "true"))
		denied(t, "label a broken pod without the sidecar annotation", label(c, pods["no-sidecar"], broken, "true"))
		denied(t, "another label", label(c, pods["broken"], "app", "evil"))
		denied(t, "another value", label(c, pods["broken"], broken, "false"))
		denied(t, "delete (not this component's)", del(c, pods["broken"]))
		if err := label(c, pods["broken"], broken, "true"); err != nil {
			t.Errorf("label the broken sidecar pod of its node: %v", err)
		}
		got, err := testEnv.CP.Admin.CoreV1().Pods(pods["broken"].Namespace).Get(ctx, "broken", metav1.GetOptions{})
		if err != nil || got.Labels[broken] != "true" || got.Labels["app"] != "broken" {
			t.Errorf("after the label: %v %v", got.Labels, err)
		}
	})
}
