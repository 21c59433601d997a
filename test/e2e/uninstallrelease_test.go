//go:build e2e

package e2e

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestUninstallReleasesPendingPods: ambientd uninstalled from the node
// (its DaemonSet deleted, --handover none: no node agent after it) while a
// gated mesh pod is pending — its rules in place, no ztunnel carrying it.
// Nothing will write the pod's condition again: left as it was, it would
// be NotReady for ever with its traffic captured to no proxy. The agent's
// last act releases it: its rules are gone from its network namespace, its
// condition is True/Uninstalled and its redirection annotation is removed.
func TestUninstallReleasesPendingPods(t *testing.T) {
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	ds := applyAgentDaemonSet(t, testutil.Context(t, 3*time.Minute))
	s := newScenario(t, "uninstall-release", withoutZtunnel(), agentArgs(
		"--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace,
	))
	ctx, a := s.ctx, s.agent

	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "held", Mutate: func(p *corev1.Pod) {
		p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podCondition}}
	}})
	waitAnnotation(t, ctx, p, "pending")
	if rules := podRules(t, p); !strings.Contains(rules, "ISTIO_OUTPUT") {
		t.Fatalf("pending pod has no rules:\n%s", rules)
	}

	deleteAgentDaemonSet(t, ctx, ds)
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}

	obj, err := testEnv.CP.Admin.CoreV1().Pods(s.ns).Get(ctx, "held", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if c := enrolledCondition(obj); c == nil || c.Status != corev1.ConditionTrue || c.Reason != agent.ReasonUninstalled {
		t.Errorf("pending gated pod after the uninstall: condition %+v, want True/%s (else NotReady for ever)\nagent log:\n%s", c, agent.ReasonUninstalled, a.LogTail(30))
	}
	if v, ok := obj.Annotations[podmeta.AnnotationRedirection]; ok {
		t.Errorf("redirection annotation %q left on a released pod", v)
	}
	if rules := podRules(t, p); strings.Contains(rules, "ISTIO_") {
		t.Errorf("released pod keeps capture rules, its traffic sent to no proxy:\n%s", rules)
	}
}
