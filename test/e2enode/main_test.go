//go:build e2enode

// Package e2enode holds the real-node tests: kubelet, containerd and runc,
// kube-controller-manager and kube-scheduler on e2eenv's control plane, all in
// one throwaway node network namespace (internal/nodeenv). Run with
// `make e2e-node` (hack/e2e-node.sh), or directly as root:
//
//	go test -tags e2enode -count=1 -v ./test/e2enode/...
package e2enode

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/ambientd/ambientd/internal/nodeenv"
)

// node is shared by every test of the package; TestMain brings it up once.
var node *nodeenv.Node

// registerTaint is set by kubelet at registration; PreferNoSchedule, so the
// suite's pods still schedule.
var registerTaint = corev1.Taint{Key: "ambientd.test/registered-by-kubelet", Value: "yes", Effect: corev1.TaintEffectPreferNoSchedule}

func TestMain(m *testing.M) {
	nodeenv.Main(m, nodeenv.Options{RegisterTaints: []corev1.Taint{registerTaint}}, func(n *nodeenv.Node) { node = n })
}

// testContext is bounded generously (the machine may be busy building) and
// cancelled when the test ends.
func testContext(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// logsOnFailure prints the node's component logs when t failed.
func logsOnFailure(t *testing.T) {
	t.Helper()
	for _, p := range []interface{ LogOnFailure(testing.TB) }{node.Kubelet, node.Containerd, node.ControllerManager, node.Scheduler} {
		p.LogOnFailure(t)
	}
}

// namespace creates a namespace for the test (deleted at the end).
func namespace(t *testing.T, ctx context.Context, name string) string {
	t.Helper()
	if _, err := node.Env.CreateNamespace(ctx, name, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = node.Env.CP.Admin.CoreV1().Namespaces().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// waitPod polls the pod until cond holds; on timeout the error names the
// pod's phase and conditions.
func waitPod(ctx context.Context, ns, name string, cond func(*corev1.Pod) bool) (*corev1.Pod, error) {
	var last *corev1.Pod
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = p
		return cond(p), nil
	})
	if err != nil {
		return last, fmt.Errorf("pod %s/%s: %w; last seen: %s", ns, name, err, describe(last))
	}
	return last, nil
}

func podReady(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func describe(p *corev1.Pod) string {
	if p == nil {
		return "never"
	}
	s := fmt.Sprintf("phase %s node %q ip %q", p.Status.Phase, p.Spec.NodeName, p.Status.PodIP)
	for _, c := range p.Status.Conditions {
		s += fmt.Sprintf("; %s=%s %s", c.Type, c.Status, c.Message)
	}
	for _, c := range p.Status.ContainerStatuses {
		if c.State.Waiting != nil {
			s += fmt.Sprintf("; container %s waiting: %s %s", c.Name, c.State.Waiting.Reason, c.State.Waiting.Message)
		}
	}
	return s
}
