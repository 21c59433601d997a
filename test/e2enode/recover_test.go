//go:build e2enode

package e2enode

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// An uninstall nobody finished, on the real node (docs/install.md): the
// agent's DaemonSet uninstalled while the agent cannot finish, then a new
// pod in `default` starts with no manual step and the node's CNI conf and
// bin dirs are as before the install.

// installWith (re)applies the agent's overlay with env in its container
// and waits until the rolled agent is ready.
func (r *agentRun) installWith(t *testing.T, ctx context.Context, env map[string]string) {
	t.Helper()
	if err := node.ImportImage(ctx, agentImageArchive(t)); err != nil {
		t.Fatal(err)
	}
	dir, err := node.WriteAgentOverlayEnv(t.TempDir(), nodeenv.AgentTag, env)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := node.Kubectl(ctx, "apply", "-k", dir); err != nil {
		t.Fatalf("kubectl apply -k: %v\n%s", err, out)
	}
	r.overlay = dir
	// Ready needs the ztunnel emulator; with an agent already installed
	// (an earlier step), the new settings roll it: wait for that too.
	r.serveAndWaitReady(t, ctx)
	if out, err := node.Kubectl(ctx, "rollout", "status", "-n", "istio-system", "daemonset/ambientd", "--timeout=2m"); err != nil {
		t.Fatalf("rollout: %v\n%s", err, out)
	}
	r.serveAndWaitReady(t, ctx)
	if !pluginInstalled(t) {
		t.Fatalf("plugin not in the runtime's config after the install:\n%s", runtimeConfig(t))
	}
}

func leaseFile() string { return filepath.Join(node.CNIBinDir, cniapi.PluginType+cniapi.LeaseSuffix) }

// agentPID is the running agent's pid (the DaemonSet's container runs in
// the host PID namespace, which is this test's).
func agentPID(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) >= 2 && filepath.Base(args[0]) == "ambientd" && args[1] == "run" {
			if pid, err := strconv.Atoi(e.Name()); err == nil {
				return pid
			}
		}
	}
	t.Fatal("no ambientd run process on the node")
	return 0
}

// newPodInDefaultStarts creates a pod in `default` with labels and waits
// until it is Ready, or only Running when gated: a mesh pod started after
// an uninstall keeps the readiness gate the admission policy gave it, and
// no agent is left to set the condition.
func newPodInDefaultStarts(t *testing.T, ctx context.Context, name string, labels map[string]string) {
	t.Helper()
	admin := node.Env.CP.Admin
	if _, err := admin.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}, Spec: appPodSpec()}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		err := admin.CoreV1().Pods(metav1.NamespaceDefault).Delete(context.Background(), name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete pod default/%s: %v", name, err)
		}
	})
	start := time.Now()
	started := podReady
	if len(labels) > 0 {
		started = func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning }
	}
	p, err := waitPod(ctx, metav1.NamespaceDefault, name, started)
	if err != nil {
		evs, _ := admin.CoreV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
		for _, e := range evs.Items {
			t.Logf("event: %s %s", e.Reason, e.Message)
		}
		t.Fatalf("a new pod in default with no agent on the node: %v", err)
	}
	t.Logf("new pod in default started in %s: %s", time.Since(start).Round(time.Millisecond), describe(p))
}

func waitAgentPodGone(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := nodeenv.Poll(ctx, "agent pod gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return p == nil, err
	}); err != nil {
		t.Fatal(err)
	}
}

// uninstallInterruptedBySIGKILLRecovers: the documented uninstall command;
// the agent, told to stop, decides to uninstall and starts handing the node
// over (AMBIENTD_HANDOVER=istio), and is SIGKILLed right then (an OOM kill,
// a kubelet out of grace). The node recovers with no manual step.
func (r *agentRun) uninstallInterruptedBySIGKILLRecovers(t *testing.T, ctx context.Context) {
	r.installWith(t, ctx, map[string]string{"AMBIENTD_HANDOVER": "istio"})
	pid := agentPID(t)
	del := exec.CommandContext(ctx, node.Bins.Kubectl, append([]string{"--kubeconfig=" + node.Env.CP.AdminKubeconfig}, uninstallCommand(r.overlay)...)...)
	var out bytes.Buffer
	del.Stdout, del.Stderr = &out, &out
	if err := del.Start(); err != nil {
		t.Fatal(err)
	}
	decided := false
	for deadline := time.Now().Add(time.Minute); !decided && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		b, err := os.ReadFile(leaseFile())
		decided = err == nil && bytes.Contains(b, []byte(`"`+cniapi.LeaseUninstalling+`"`))
	}
	killErr := syscall.Kill(pid, syscall.SIGKILL)
	werr := del.Wait()
	r.overlay = ""
	t.Logf("kubectl %s (%v):\n%s", strings.Join(uninstallCommand("<overlay>"), " "), werr, out.String())
	if !decided || killErr != nil {
		t.Fatalf("the agent's lease never said uninstalling (%v), or the kill failed: %v", decided, killErr)
	}
	waitAgentPodGone(t, ctx)
	if !pluginInstalled(t) {
		t.Fatalf("the agent finished its uninstall before the kill; nothing to recover:\n%s", runtimeConfig(t))
	}
	t.Log("agent SIGKILLed after deciding to uninstall; the plugin is still in the runtime's config")
	newPodInDefaultStarts(t, ctx, "after-uninstall-sigkill", nil)
	r.cniDirsAsBefore(t)
}

// uninstallInterruptedByRebootRecovers: the node goes down (kubelet,
// containerd and every container killed: the agent sees nothing) while the
// operator deletes the agent's DaemonSet; it comes back with its agent pod
// deleted, so no agent ever starts on it again. The next mesh pod's ADD
// finds no agent, reads from the API that the DaemonSet is gone (proof,
// not time), finishes the uninstall and starts; the node's CNI dirs are as
// before the install. (With the whole installation deleted meanwhile, the
// plugin's own identity is gone too and nothing can be proved: the node's
// pods wait until `ambientd uninstall` runs there — docs/install.md.)
func (r *agentRun) uninstallInterruptedByRebootRecovers(t *testing.T, ctx context.Context) {
	r.installWith(t, ctx, nil)
	if err := node.PowerOff(ctx); err != nil {
		t.Errorf("power off: %v", err)
		if err := node.PowerOn(ctx); err != nil {
			t.Errorf("power on: %v", err)
		}
		t.FailNow()
	}
	if out, err := node.Kubectl(ctx, "delete", "daemonset", "-n", "istio-system", "ambientd", "--wait=false"); err != nil {
		t.Errorf("kubectl delete daemonset while the node is down: %v\n%s", err, out)
	}
	if err := node.PowerOn(ctx); err != nil {
		t.Fatalf("power on: %v", err)
	}
	waitAgentPodGone(t, ctx)
	if !pluginInstalled(t) {
		t.Fatalf("the plugin left the runtime's config with no agent running:\n%s", runtimeConfig(t))
	}
	newPodInDefaultStarts(t, ctx, "after-uninstall-reboot", map[string]string{"istio.io/dataplane-mode": "ambient"})
	r.cniDirsAsBefore(t)
	if out, err := node.Kubectl(ctx, "delete", "-k", r.overlay, "--wait=false", "--ignore-not-found"); err != nil {
		t.Errorf("kubectl delete -k: %v\n%s", err, out)
	}
	r.overlay = ""
}

// cniDirsAsBefore: the node's CNI conf dir byte for byte as before the
// install, no plugin binary or install lease in its bin dir.
func (r *agentRun) cniDirsAsBefore(t *testing.T) {
	t.Helper()
	if got := []byte(conflist(t)); string(got) != string(r.pristine.conflist) {
		t.Errorf("conflist differs from before the install:\nbefore:\n%s\nafter:\n%s", r.pristine.conflist, got)
	}
	if got := confDirFiles(t); len(got) != len(r.pristine.confDir) {
		t.Errorf("CNI conf dir holds %d files, %d before the install", len(got), len(r.pristine.confDir))
	} else {
		for name, b := range got {
			if !bytes.Equal(b, r.pristine.confDir[name]) {
				t.Errorf("CNI conf dir: %s differs from before the install", name)
			}
		}
	}
	for _, name := range []string{cniapi.PluginType, cniapi.PluginType + cniapi.LeaseSuffix, cniapi.PluginType + cniapi.KubeconfigSuffix} {
		if _, err := os.Stat(filepath.Join(node.CNIBinDir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still in the node's bin dir (%v)", name, err)
		}
	}
}
