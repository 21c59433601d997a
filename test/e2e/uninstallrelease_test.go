//go:build e2e

package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

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
	var ds *unstructured.Unstructured
	for _, o := range renderDeploy(t) {
		if o.GetKind() == "DaemonSet" {
			ds = o
		}
	}
	ctx := testutil.Context(t, 3*time.Minute)
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	if err := serverSideApply(ctx, dyn, mapper, ds, false); err != nil {
		t.Fatalf("creating the DaemonSet: %v", err)
	}
	admin := testEnv.CP.Admin
	t.Cleanup(func() {
		_ = admin.AppsV1().DaemonSets(ds.GetNamespace()).Delete(context.Background(), ds.GetName(), metav1.DeleteOptions{})
	})
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

	if err := admin.AppsV1().DaemonSets(ds.GetNamespace()).Delete(ctx, ds.GetName(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "DaemonSet gone", time.Minute, func() bool {
		_, err := admin.AppsV1().DaemonSets(ds.GetNamespace()).Get(ctx, ds.GetName(), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}

	obj, err := admin.CoreV1().Pods(s.ns).Get(ctx, "held", metav1.GetOptions{})
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
