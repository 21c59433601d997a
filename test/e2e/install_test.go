//go:build e2e

package e2e

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestAgentInstallCNI runs bin/ambientd with --install-cni (default
// settings: owned mode) against a temporary host CNI tree: it installs the
// plugin and its own conflist, which the runtime uses, never touching the
// primary's file; stopped while its DaemonSet exists and selects the node
// (an upgrade) it leaves them in place; stopped after the DaemonSet is
// deleted it uninstalls, leaving the conf dir as it was before the install.
func TestAgentInstallCNI(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	primary := "{\n  \"cniVersion\": \"1.0.0\",\n  \"name\": \"k8s-pod-network\",\n  \"plugins\": [\n    {\"type\": \"calico\", \"mtu\": 1440},\n    {\"type\": \"portmap\", \"capabilities\": {\"portMappings\": true}}\n  ]\n}\n"
	confPath := filepath.Join(confDir, "10-calico.conflist")
	if err := os.WriteFile(confPath, []byte(primary), 0o600); err != nil {
		t.Fatal(err)
	}
	installed := func() bool {
		if daemon.PluginInConfDir(confDir, "ambientd-cni") != nil {
			return false
		}
		if b, err := os.ReadFile(confPath); err != nil || string(b) != primary {
			t.Errorf("the primary's config changed (%v):\n%s", err, b)
		}
		_, err := os.Stat(filepath.Join(binDir, "ambientd-cni"))
		return err == nil
	}
	start := func(name string) *e2eenv.Agent {
		a, err := testEnv.StartAgent(ctx, e2eenv.AgentConfig{Name: name, Args: []string{
			"--install-cni", "--cni-bin-dir=" + binDir, "--cni-conf-dir=" + confDir,
			"--cni-bin-source=" + testEnv.Bins.CNIPlugin, "--daemonset-namespace=" + e2eenv.AgentNamespace,
		}})
		if err != nil {
			t.Fatal(err)
		}
		a.LogOnFailure(t)
		t.Cleanup(func() { _ = a.Stop(10 * time.Second) })
		// Live: the process is past start-up (signals handled, installer running).
		if err := a.WaitLive(ctx); err != nil {
			t.Fatalf("%s not live: %v", name, err)
		}
		testutil.Eventually(t, name+" installed the plugin", time.Minute, installed)
		return a
	}

	// The DaemonSet from deploy/ exists and selects this node (its
	// nodeSelector kubernetes.io/os=linux matches the environment's node).
	ds := applyAgentDaemonSet(t, ctx)

	a := start("agent-install-1")
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if !installed() {
		t.Fatalf("stopping with the DaemonSet in place (an upgrade) removed the plugin:\n%s", a.LogTail(30))
	}
	if !strings.Contains(a.Logs(), "leaving the CNI plugin") {
		t.Errorf("agent did not log its upgrade decision:\n%s", a.LogTail(30))
	}

	a = start("agent-install-2")
	deleteAgentDaemonSet(t, ctx, ds)
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(confPath); string(b) != primary {
		t.Fatalf("after uninstall-on-delete the config is\n%s\nwant the original\n%s\nagent log:\n%s", b, primary, a.LogTail(30))
	}
	if entries, _ := os.ReadDir(confDir); len(entries) != 1 {
		t.Fatalf("after uninstall-on-delete the conf dir holds %d files, want only the primary's", len(entries))
	}
	if _, err := os.Stat(filepath.Join(binDir, "ambientd-cni")); !os.IsNotExist(err) {
		t.Fatalf("plugin binary left after uninstall-on-delete: %v", err)
	}
}

// TestInstallerUnreadyUntilItWorks: bin/ambientd run --install-cni whose conf
// dir cannot be used — the path is a regular file, so the kernel answers
// ENOTDIR to everything the installer tries. The agent runs (live, ztunnel
// connected) but is not ready: /readyz fails and the node condition is
// False/PluginNotInstalled, both saying the installer is failing and why.
// The installer keeps retrying on its own (it is supervised, not a goroutine
// that died): once the conf dir is a directory with the primary's config,
// the plugin is installed and /readyz and the condition turn ready without a
// restart.
func TestInstallerUnreadyUntilItWorks(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	node := testEnv.NodeName
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(filepath.Dir(confDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(confDir, []byte("a file where the conf dir should be"), 0o644); err != nil {
		t.Fatal(err)
	}
	startEmulator(t, ctx, "ztunnel-installer")
	a := startAgent(t, ctx, "--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace,
		"--node-condition-resync=200ms")
	n := waitNode(t, ctx, node, "condition False/PluginNotInstalled naming the installer's failure", func(n *corev1.Node) bool {
		c := nodeCondition(n)
		return c != nil && c.Status == corev1.ConditionFalse && c.Reason == nodeready.ReasonPluginNotInstalled &&
			strings.Contains(c.Message, "CNI installer failing") && strings.Contains(c.Message, "not a directory")
	})
	t.Logf("node condition: %s", nodeCondition(n).Message)
	err := a.WaitReady(testutil.Context(t, 2*time.Second))
	if err == nil || !strings.Contains(err.Error(), "CNI installer failing") {
		t.Fatalf("/readyz while the installer cannot work: %v, want a failure naming it", err)
	}
	t.Logf("/readyz: %s", strings.SplitN(err.Error(), "\n", 2)[0])

	// The cause goes away.
	if err := os.Remove(confDir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	primary := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"}]}`
	if err := os.WriteFile(filepath.Join(confDir, "10-calico.conflist"), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
	fixed := time.Now()
	if err := a.WaitReady(ctx); err != nil {
		t.Fatalf("/readyz after the conf dir became usable: %v\n%s", err, a.LogTail(30))
	}
	waitNode(t, ctx, node, "condition True again", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))
	t.Logf("conf dir usable -> /readyz 200 and condition True: %s", time.Since(fixed).Round(time.Millisecond))
	if err := daemon.PluginInConfDir(confDir, "ambientd-cni"); err != nil {
		t.Fatalf("runtime's config after recovery: %v", err)
	}
	if !strings.Contains(a.Logs(), "CNI installer working again") {
		t.Errorf("the agent did not log its recovery:\n%s", a.LogTail(30))
	}
}

// TestPrimaryWithdrawnIsFollowed: bin/ambientd run --install-cni (owned
// mode) beside a primary CNI that withdraws its config (a CNI uninstall or
// migration) and later a new primary that writes its own. Within 10 s of
// the withdrawal our copy is gone too — the runtime no longer gets the
// withdrawn network through us — and /readyz, the node condition and
// `ambientd status` all say the primary was withdrawn; within 10 s of the
// new primary's file the runtime uses our copy of it, our plugin last, and
// the agent is ready again.
func TestPrimaryWithdrawnIsFollowed(t *testing.T) {
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	primary := filepath.Join(confDir, "10-calico.conflist")
	if err := os.WriteFile(primary, []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	s := newScenario(t, "withdraw", agentArgs("--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace,
		"--node-condition-resync=200ms", "--cni-withdraw-grace=1s"))
	ctx, node := s.ctx, testEnv.NodeName
	if err := daemon.PluginInConfDir(confDir, "ambientd-cni"); err != nil {
		t.Fatalf("not installed at start: %v", err)
	}

	if err := os.Remove(primary); err != nil {
		t.Fatal(err)
	}
	withdrawn := time.Now()
	testutil.Eventually(t, "the runtime has no config through us", 10*time.Second, func() bool {
		_, err := cniinstall.RuntimeConfig(confDir)
		return errors.Is(err, cniinstall.ErrNoConfig)
	})
	t.Logf("primary withdrawn -> our copy gone: %s", time.Since(withdrawn).Round(time.Millisecond))
	says := func(msg string) bool { return strings.Contains(msg, "10-calico.conflist was withdrawn") }
	n := waitNode(t, ctx, node, "condition False/PluginNotInstalled naming the withdrawn primary", func(n *corev1.Node) bool {
		c := nodeCondition(n)
		return c != nil && c.Status == corev1.ConditionFalse && c.Reason == nodeready.ReasonPluginNotInstalled && says(c.Message)
	})
	t.Logf("node condition within %s: %s", time.Since(withdrawn).Round(time.Millisecond), nodeCondition(n).Message)
	if err := s.agent.WaitReady(testutil.Context(t, 2*time.Second)); err == nil || !says(err.Error()) {
		t.Errorf("/readyz after the withdrawal: %v, want it to name the withdrawn primary", err)
	}
	if st := statusJSON(t, ctx); !says(strings.Join(st.NotReady, "; ")) {
		t.Errorf("ambientd status not ready = %q, want it to name the withdrawn primary", st.NotReady)
	}

	if err := os.WriteFile(filepath.Join(confDir, "05-cilium.conflist"), []byte(`{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	testutil.Eventually(t, "the runtime uses our copy of the new primary", 10*time.Second, func() bool {
		rc, err := cniinstall.RuntimeConfig(confDir)
		return err == nil && strings.Join(rc.Types, ",") == "cilium-cni,ambientd-cni"
	})
	t.Logf("new primary -> used with our plugin last: %s", time.Since(back).Round(time.Millisecond))
	if err := s.agent.WaitReady(ctx); err != nil {
		t.Fatalf("not ready with the new primary: %v", err)
	}
	waitNode(t, ctx, node, "condition True again", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))
}
