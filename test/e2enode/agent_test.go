//go:build e2enode

package e2enode

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// agentRun is the agent's DaemonSet on the node and the ztunnel emulator.
type agentRun struct {
	overlay  string
	em       *e2eenv.Emulator
	pristine pristineNode // the node before the first install
	// gate is how the install adds the readiness gate: "webhook" (the
	// chart before Kubernetes 1.36), else the MutatingAdmissionPolicy.
	gate string
}

func (r *agentRun) gateMechanism() string {
	if r.gate == "" {
		return "policy"
	}
	return r.gate
}

// TestAgentOnRealNode runs ambientd's own DaemonSet (deploy/ through a test
// overlay, the image `make image` built) on the node, with the ztunnel
// emulator at the node's ztunnel socket, and kubelet-created pods in an
// ambient namespace. The subtests share the DaemonSet and run in order.
// Each step is a method of agentRun in a file of its own (install_test.go,
// enroll_test.go, sidecar_test.go, …, uninstall_test.go); the helpers they
// share are in helpers_node_test.go (the node, its CNI config, processes and
// netns), helpers_pods_test.go (namespaces, pods, connections, Ready
// watches) and helpers_capture_test.go (the emulator's view: capture before
// start, kept through a roll).
func TestAgentOnRealNode(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 15*time.Minute)
	// Last: the steps' namespaces are deleted asynchronously; the node is
	// back to its state before (no pod netns, lease, task, shim or cgroup
	// left) before the next test looks at it.
	node.RestoredAtCleanup(t, ctx, "the agent tests")
	r := &agentRun{pristine: readPristine(t)}
	t.Cleanup(func() { r.remove(t) })
	steps := []struct {
		name string
		fn   func(*testing.T, context.Context)
	}{
		{"DaemonSetReadyOnlyAfterZtunnel", r.daemonSetReadyOnlyAfterZtunnel},
		{"AmbientPodEnrolledCapturedReady", r.ambientPodEnrolledCapturedReady},
		{"SidecarPodCapturedValidated", r.sidecarPodCapturedValidated},
		{"SidecarSkipCases", r.sidecarSkipCases},
		{"SidecarPodWithoutPluginRepaired", r.sidecarPodWithoutPluginRepaired},
		{"SidecarNamespaceMigratesToAmbient", r.sidecarNamespaceMigratesToAmbient},
		{"SidecarBrokenPodDeleted", r.sidecarBrokenPodDeleted},
		{"GatedPodNotReadyWithoutZtunnel", r.gatedPodNotReadyWithoutZtunnel},
		{"ZtunnelGoneDropsEndpoints", r.ztunnelGoneDropsEndpoints},
		{"AdmissionGatesFromPolicy", r.admissionGatesFromPolicy},
		{"StartupCost", r.startupCost},
		{"SandboxRecreatedStaysEnrolled", r.sandboxRecreatedStaysEnrolled},
		{"StaticPods", r.staticPods},
		{"ContainersRestartStayEnrolled", r.containersRestartStayEnrolled},
		{"HostNetworkPodNeverAPod", r.hostNetworkPodNeverAPod},
		{"RollingUpdateKeepsCapture", r.rollingUpdateKeepsCapture},
		{"AgentPodForceDeletedKeepsPlugin", r.agentPodForceDeletedKeepsPlugin},
		{"ImageThatCannotBePulled", r.imageThatCannotBePulled},
		{"MultusOnTheNode", r.multusOnTheNode},
		{"NodeRebootCapturesBeforeReady", r.nodeRebootCapturesBeforeReady},
		{"UninstallInterruptedBySIGKILLRecovers", r.uninstallInterruptedBySIGKILLRecovers},
		{"UninstallInterruptedByRebootRecovers", r.uninstallInterruptedByRebootRecovers},
		{"UninstallLeavesNodeAsBefore", r.uninstallLeavesNodeAsBefore},
	}
	for _, s := range steps {
		if !t.Run(s.name, func(t *testing.T) {
			t.Cleanup(func() { agentDiagnostics(t) })
			ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
			defer cancel()
			s.fn(t, ctx)
		}) {
			return
		}
	}
}

// agentDiagnostics prints, when t failed, the agent's log and the node's
// host rules (the agent runs in the host network: the node netns).
func agentDiagnostics(t *testing.T) {
	if !t.Failed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	logs, err := node.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/ambientd", "--tail=200")
	t.Logf("agent log (%v):\n%s", err, logs)
	for _, args := range [][]string{{"iptables-save"}, {"ipset", "list"}, {"nft", "list", "ruleset"}} {
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		t.Logf("node netns: %s (%v):\n%s", strings.Join(args, " "), err, out)
	}
	if entries, err := os.ReadDir(node.NetnsDir); err == nil {
		for _, e := range entries {
			out, err := exec.CommandContext(ctx, "ip", "netns", "exec", e.Name(), "nft", "list", "ruleset").CombinedOutput()
			t.Logf("pod netns %s: nft list ruleset (%v):\n%s", e.Name(), err, out)
		}
	}
}

// remove deletes the DaemonSet (the agent then uninstalls its plugin: the
// DaemonSet is gone) and stops the emulator.
func (r *agentRun) remove(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if r.overlay != "" {
		err := node.Env.CP.Admin.AppsV1().DaemonSets("istio-system").Delete(ctx, "ambientd", metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete DaemonSet: %v", err)
		}
		if err := nodeenv.Poll(ctx, "agent pod gone and plugin uninstalled", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
			p, err := node.AgentPod(ctx)
			return p == nil && !pluginInstalled(t), err
		}); err != nil {
			t.Errorf("%v; runtime's CNI config %s", err, runtimeConfig(t))
		}
		// A step failed before the uninstall step: the install's
		// cluster-scoped objects (admission policies, RBAC) go too, or the
		// next test's install finds them owned by another field manager.
		if r.overlay != "helm" {
			if out, err := node.Kubectl(ctx, "delete", "-k", overlay(t, nodeenv.AgentTag), "--ignore-not-found"); err != nil {
				t.Errorf("kubectl delete -k: %v: %s", err, out)
			}
		}
	}
	if r.em != nil {
		if err := r.em.Stop(5 * time.Second); err != nil {
			t.Logf("emulator stop: %v", err)
		}
	}
}
