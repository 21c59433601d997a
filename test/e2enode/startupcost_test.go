//go:build e2enode

package e2enode

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// startupCost measures pod create -> Ready on this node for a pod outside
// the mesh and for an ambient pod with the readiness gate (same image and
// probe), one after the other. It prints numbers; it asserts only that both
// become Ready.
func (r *agentRun) startupCost(t *testing.T, ctx context.Context) {
	plain := namespace(t, ctx, "cost-plain")
	ambient := ambientNamespace(t, ctx, "cost-ambient")
	for i := range 3 {
		for _, c := range []struct {
			ns  string
			pod *corev1.Pod
		}{
			{plain, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app"}, Spec: appPodSpec()}},
			{ambient, nodeenv.GatedPod("app")},
		} {
			start := time.Now()
			if _, err := node.Env.CP.Admin.CoreV1().Pods(c.ns).Create(ctx, c.pod, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := waitPod(ctx, c.ns, "app", podReady); err != nil {
				t.Fatal(err)
			}
			t.Logf("run %d: %s pod create -> Ready: %s", i+1, c.ns, time.Since(start).Round(time.Millisecond))
			deletePodsAndWait(t, ctx, c.ns, metav1.ListOptions{FieldSelector: "metadata.name=app"})
		}
	}
}
