//go:build e2enode

package e2enode

import (
	"context"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// uninstallCommand is docs/install.md's uninstall, word for word but for
// the kustomization (the suite's overlay of deploy/ instead of deploy/).
func uninstallCommand(kustomization string) []string {
	return []string{"delete", "-k", kustomization, "--cascade=foreground"}
}

// pristineNode is the node's CNI state before the agent was ever installed.
type pristineNode struct {
	conflist []byte
	confDir  map[string][]byte // every file of the CNI conf dir
}

// primaryRewrote takes the primary CNI's own rewrite of its conflist (a
// simulated primary installer at boot) as the state an uninstall must leave.
func (p *pristineNode) primaryRewrote(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(node.CNIConfDir, nodeenv.Conflist))
	if err != nil {
		t.Fatal(err)
	}
	p.conflist = b
	p.confDir[nodeenv.Conflist] = b
}

// confDirFiles reads every file of the node's CNI conf dir.
func confDirFiles(t *testing.T) map[string][]byte {
	t.Helper()
	entries, err := os.ReadDir(node.CNIConfDir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(node.CNIConfDir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = b
	}
	return out
}

func readPristine(t *testing.T) pristineNode {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(node.CNIConfDir, nodeenv.Conflist))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), `"ambientd-cni"`) {
		t.Fatalf("the node's conflist mentions ambientd before the agent ran:\n%s", b)
	}
	if _, err := os.Stat(filepath.Join(node.CNIBinDir, "ambientd-cni")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("ambientd-cni in the node's bin dir before the agent ran (%v)", err)
	}
	return pristineNode{conflist: b, confDir: confDirFiles(t)}
}

// ensureInstalled installs the DaemonSet and the ztunnel emulator and waits
// until the agent is ready, unless an earlier step did (a scenario run
// alone with E2E_RUN).
func (r *agentRun) ensureInstalled(t *testing.T, ctx context.Context) {
	t.Helper()
	if r.overlay != "" {
		return
	}
	if err := node.ImportImage(ctx, agentImageArchive(t)); err != nil {
		t.Fatal(err)
	}
	r.overlay = overlay(t, nodeenv.AgentTag)
	if _, err := node.Kubectl(ctx, "apply", "-k", r.overlay); err != nil {
		t.Fatal(err)
	}
	r.serveAndWaitReady(t, ctx)
}

// serveAndWaitReady starts the ztunnel emulator unless one runs, then waits
// until the installed agent answers /readyz with 200.
func (r *agentRun) serveAndWaitReady(t *testing.T, ctx context.Context) {
	t.Helper()
	if r.em == nil {
		em, err := node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
		if err != nil {
			t.Fatal(err)
		}
		r.em = em
	}
	if err := nodeenv.Poll(ctx, "agent ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		code, _, err := nodeenv.AgentReadyz(ctx)
		return err == nil && code == http.StatusOK, err
	}); err != nil {
		t.Fatal(err)
	}
}

// uninstallLeavesNodeAsBefore: with ambient pods enrolled, the documented
// uninstall command, exactly (kubectl deletes the kustomization's objects in
// its order — ServiceAccount and RBAC before the DaemonSet — and
// kube-controller-manager's garbage collector deletes the agent's pod):
// istio-system and a Secret placed there beforehand stay; the node's conflist
// is byte for byte what it was before the install; the plugin binary and the
// host probe rules are gone; a new pod in `default` starts and turns Ready.
func (r *agentRun) uninstallLeavesNodeAsBefore(t *testing.T, ctx context.Context) {
	admin := node.Env.CP.Admin
	r.ensureInstalled(t, ctx)
	secret, err := admin.CoreV1().Secrets("istio-system").Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "istio-ca-secret-e2e"},
		Data:       map[string][]byte{"ca-cert.pem": []byte("not really a CA")},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = admin.CoreV1().Secrets("istio-system").Delete(context.Background(), secret.Name, metav1.DeleteOptions{})
	})
	ns := ambientNamespace(t, ctx, "ambient-uninstall")
	for _, name := range []string{"a", "b"} {
		if _, err := admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod(name), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"a", "b"} {
		if _, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool {
			return podReady(p) && p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled
		}); err != nil {
			t.Fatal(err)
		}
	}
	if !pluginInstalled(t) {
		t.Fatalf("plugin not in the CNI config the runtime uses before the uninstall:\n%s", runtimeConfig(t))
	}

	// The agent's log, followed to its end: its own account of the
	// shutdown decision.
	agentPod, err := node.AgentPod(ctx)
	if err != nil || agentPod == nil {
		t.Fatalf("agent pod: %v", err)
	}
	var agentLog strings.Builder
	follow := exec.CommandContext(ctx, node.Bins.Kubectl, "--kubeconfig="+node.Env.CP.AdminKubeconfig, "logs", "-f", "-n", "istio-system", agentPod.Name)
	follow.Stdout = &agentLog
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}

	// The install's kustomization (an earlier step's overlay dir went with
	// that step: the same overlay again; the image tag does not matter to
	// a delete).
	kustomization := overlay(t, nodeenv.AgentTag)
	start := time.Now()
	out, err := node.Kubectl(ctx, uninstallCommand(kustomization)...)
	t.Logf("kubectl %s (%s, %v):\n%s", strings.Join(uninstallCommand("<overlay>"), " "), time.Since(start).Round(time.Millisecond), err, out)
	if err != nil {
		t.Fatal(err) // the cleanup deletes the DaemonSet
	}
	r.overlay = "" // nothing left for the cleanup to delete
	if err := nodeenv.Poll(ctx, "agent pod gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return p == nil, err
	}); err != nil {
		t.Error(err)
	}
	_ = follow.Wait() // ends with the container
	decision := ""
	for _, line := range strings.Split(agentLog.String(), "\n") {
		if strings.Contains(line, "uninstalling from the node") || strings.Contains(line, "leaving the CNI plugin") || strings.Contains(line, "cannot tell uninstall from upgrade") {
			decision = line
		}
	}
	if !strings.Contains(decision, "uninstalling from the node") {
		t.Errorf("the agent's shutdown decision: %q, want it to uninstall; its log:\n%s", decision, agentLog.String())
	}
	t.Logf("the agent's shutdown decision: %s", decision)
	// No waiting beyond the pod: the agent uninstalled before it exited.
	r.nodeLeftAsBefore(t, ctx)
	t.Logf("uninstall command -> node as before: %s", time.Since(start).Round(time.Millisecond))

	// Istio's namespace and what is in it are untouched.
	nsObj, err := admin.CoreV1().Namespaces().Get(ctx, "istio-system", metav1.GetOptions{})
	if err != nil || nsObj.DeletionTimestamp != nil {
		t.Errorf("namespace istio-system after the uninstall: %v (deleting: %v)", err, nsObj != nil && nsObj.DeletionTimestamp != nil)
	}
	if s, err := admin.CoreV1().Secrets("istio-system").Get(ctx, secret.Name, metav1.GetOptions{}); err != nil || string(s.Data["ca-cert.pem"]) != "not really a CA" {
		t.Errorf("Secret istio-system/%s after the uninstall: %v", secret.Name, err)
	}

	// New pods start.
	if _, err := admin.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "after-uninstall"}, Spec: appPodSpec()}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		err := admin.CoreV1().Pods(metav1.NamespaceDefault).Delete(context.Background(), "after-uninstall", metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete pod default/after-uninstall: %v", err)
		}
	})
	p, err := waitPod(ctx, metav1.NamespaceDefault, "after-uninstall", podReady)
	if err != nil {
		evs, _ := admin.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=after-uninstall"})
		for _, e := range evs.Items {
			t.Logf("event: %s %s", e.Reason, e.Message)
		}
		t.Fatalf("a new pod in default after the uninstall: %v", err)
	}
	t.Logf("new pod in default after the uninstall: %s", describe(p))
}

// nodeLeftAsBefore: the node's CNI conf dir is byte for byte what it was
// before the first install (the conflist and every other file), the plugin
// binary and the host probe rules are gone. Checked right after the
// uninstall command returned: the agent uninstalled before it exited.
func (r *agentRun) nodeLeftAsBefore(t *testing.T, ctx context.Context) {
	t.Helper()
	r.cniDirsAsBefore(t)
	for _, args := range [][]string{{"iptables-legacy-save", "-t", "nat"}, {"iptables-nft-save", "-t", "nat"}, {"nft", "list", "tables"}} {
		if _, err := exec.LookPath(args[0]); err != nil {
			continue
		}
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err != nil || strings.Contains(string(out), "ISTIO_POSTRT") || strings.Contains(string(out), "istio-ambient") {
			t.Errorf("host probe rules left after the uninstall: %s (%v):\n%s", strings.Join(args, " "), err, out)
		}
	}
}
