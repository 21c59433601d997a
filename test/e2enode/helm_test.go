//go:build e2enode

package e2enode

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/build"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// helm runs the helm command (built from test/helm's pinned Helm) against
// the node's control plane, with its own config, cache and data dirs.
func helm(t *testing.T, ctx context.Context, bin, home string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, append(args, "--kubeconfig", node.Env.CP.AdminKubeconfig)...)
	cmd.Env = append(cmd.Environ(), "HELM_CONFIG_HOME="+filepath.Join(home, "config"), "HELM_CACHE_HOME="+filepath.Join(home, "cache"), "HELM_DATA_HOME="+filepath.Join(home, "data"))
	out, err := cmd.CombinedOutput()
	t.Logf("helm %s (%v):\n%s", strings.Join(args, " "), err, out)
	return string(out), err
}

// helmNodeValues are the values this node needs whatever the install: the
// image imported by the test (no registry: pull policy Never), and the
// apiserver where the agent (host network) reaches it, through the chart's
// env (no kube-proxy here).
func helmNodeValues(t *testing.T) []string {
	t.Helper()
	u, err := url.Parse(node.Env.CP.URL)
	if err != nil {
		t.Fatal(err)
	}
	return []string{
		"--set", "ambientd.image.repository=" + nodeenv.AgentImage, "--set", "ambientd.image.tag=" + nodeenv.AgentTag,
		"--set", "pullPolicy=Never",
		"--set-string", "env.KUBERNETES_SERVICE_HOST=" + u.Hostname(), "--set-string", "env.KUBERNETES_SERVICE_PORT=" + u.Port(),
	}
}

// TestHelmInstallUpgradeUninstall installs ambientd on the real node with
// the chart (deploy/helm/ambientd) and the commands docs/install.md gives:
// the agent becomes ready and the demo's ambient pods are enrolled, Ready
// and captured; `helm upgrade` with a changed value (the log level: a
// ConfigMap change only) rolls the agent, and meanwhile the enrolled pod
// gets no Del, stays Ready and enabled, and a pod created during the roll
// starts captured; `helm uninstall` leaves the node as before the install.
func TestHelmInstallUpgradeUninstall(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 8*time.Minute)
	node.RestoredAtCleanup(t, ctx, "the helm test")
	r := &agentRun{pristine: readPristine(t)}
	t.Cleanup(func() { r.remove(t) })
	t.Cleanup(func() { agentDiagnostics(t) })
	// make e2e-node builds it; a `go test` run alone builds it here.
	bins, err := build.Ensure(ctx, []build.Part{build.Helm}, build.Options{Log: os.Stderr, Name: "the helm test"})
	if err != nil {
		t.Fatal(err)
	}
	home := t.TempDir()
	chart := filepath.Join(node.Env.Root, "deploy", "helm", "ambientd")
	if err := node.ImportImage(ctx, agentImageArchive(t)); err != nil {
		t.Fatal(err)
	}
	set := append([]string{"--set", "profile=ambient"}, helmNodeValues(t)...)
	// --take-ownership: the environment's control plane starts with
	// deploy/rbac.yaml loaded (its agent identity); a cluster has none of it.
	if _, err := helm(t, ctx, bins.Helm, home, append([]string{"install", "ambientd", chart, "-n", "istio-system", "--take-ownership"}, set...)...); err != nil {
		t.Fatal(err)
	}
	r.overlay = "helm" // the cleanup deletes the DaemonSet if a step fails
	r.serveAndWaitReady(t, ctx)

	admin := node.Env.CP.Admin
	ns := ambientNamespace(t, ctx, "helm-demo")
	for _, name := range []string{"a", "b"} {
		if _, err := admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod(name), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	enrolled := func(p *corev1.Pod) bool {
		return podReady(p) && p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled
	}
	var uid string
	for _, name := range []string{"a", "b"} {
		p, err := waitPod(ctx, ns, name, enrolled)
		if err != nil {
			t.Fatal(err)
		}
		uid = string(p.UID)
	}
	if !pluginInstalled(t) {
		t.Fatalf("plugin not in the runtime's CNI config after helm install:\n%s", runtimeConfig(t))
	}

	// helm upgrade with a changed value rolls the agent without a capture gap.
	old, err := node.AgentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("agent pod: %v", err)
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	lapses := make(chan string, 1)
	go func() { // the enrolled pod, sampled all along the roll
		defer close(lapses)
		for watchCtx.Err() == nil {
			p, err := admin.CoreV1().Pods(ns).Get(watchCtx, "b", metav1.GetOptions{})
			if err == nil && !enrolled(p) {
				lapses <- describe(p)
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	start := time.Now()
	if _, err := helm(t, ctx, bins.Helm, home, "upgrade", "ambientd", chart, "-n", "istio-system", "--reuse-values", "--set", "logging.level=debug"); err != nil {
		t.Fatal(err)
	}
	waitCNIUnserved(t, ctx)
	during, err := admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("during"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "the agent rolled by helm upgrade", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return err == nil && p != nil && p.UID != old.UID && podReady(p), err
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("helm upgrade -> new agent pod Ready: %s", time.Since(start).Round(time.Millisecond))
	cm, err := admin.CoreV1().ConfigMaps("istio-system").Get(ctx, "ambientd-config", metav1.GetOptions{})
	if err != nil || cm.Data["AMBIENTD_LOG_LEVEL"] != "debug" {
		t.Errorf("ConfigMap after helm upgrade: AMBIENTD_LOG_LEVEL %q (%v), want debug", cm.Data["AMBIENTD_LOG_LEVEL"], err)
	}
	duringPod, err := waitPod(ctx, ns, "during", podReady)
	if err != nil {
		t.Fatal(err)
	}
	r.capturedBeforeStart(t, ctx, duringPod)
	stopWatch()
	if lapse, ok := <-lapses; ok {
		t.Errorf("the enrolled pod lapsed during helm upgrade: %s", lapse)
	}
	r.keptThroughTheRoll(t, ctx, "helm upgrade", uid, string(during.UID))

	// helm uninstall, as docs/install.md gives it, leaves the node as before.
	start = time.Now()
	if _, err := helm(t, ctx, bins.Helm, home, "uninstall", "ambientd", "-n", "istio-system", "--cascade", "foreground", "--wait"); err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "agent pod gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return p == nil, err
	}); err != nil {
		t.Fatal(err)
	}
	r.overlay = ""
	r.nodeLeftAsBefore(t, ctx)
	t.Logf("helm uninstall -> node as before: %s", time.Since(start).Round(time.Millisecond))
	if out, err := helm(t, ctx, bins.Helm, home, "list", "-n", "istio-system", "-q"); err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("helm list after the uninstall: %q (%v), want no release", out, err)
	}
}
