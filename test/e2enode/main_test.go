//go:build e2enode

// Package e2enode holds the real-node tests: kubelet, containerd and runc,
// kube-controller-manager and kube-scheduler on e2eenv's control plane, all in
// one throwaway node network namespace (test/infra/nodeenv). Run with
// `make e2e-node` (hack/e2e-node.sh), or directly as root:
//
//	go test -tags e2enode -count=1 -v ./test/e2enode/...
package e2enode

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// node is shared by every test of the package; TestMain brings it up once.
var node *nodeenv.Node

// registerTaint is set by kubelet at registration; PreferNoSchedule, so the
// suite's pods still schedule.
var registerTaint = corev1.Taint{Key: "ambientd.test/registered-by-kubelet", Value: "yes", Effect: corev1.TaintEffectPreferNoSchedule}

// startupTaint is the agent's startup taint, set by kubelet at registration
// as on a node where istio-cni (or ambientd) runs: only the agent, once it
// can mesh pods, removes it. Pods that do not tolerate it wait unscheduled.
var startupTaint = nodeenv.StartupTaint

func TestMain(m *testing.M) {
	nodeenv.Main(m, nodeenv.Options{RegisterTaints: []corev1.Taint{registerTaint, startupTaint}}, func(n *nodeenv.Node) { node = n })
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

// waitPod, podReady and describe: nodeenv's, for the node under test.
func waitPod(ctx context.Context, ns, name string, cond func(*corev1.Pod) bool) (*corev1.Pod, error) {
	return node.WaitPod(ctx, ns, name, cond)
}

var (
	podReady = nodeenv.PodReady
	describe = nodeenv.Describe
)
