//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// An uninstall nobody finished (docs/install.md): the agent installed with
// --install-cni into a host CNI tree of its own, the runtime (libcni)
// running whatever config the conf dir's first file says, with plugins from
// the host bin dir and the reference plugins only — so once our binary and
// config are gone, the runtime cannot find them anywhere else.

// leaseNode is a node's CNI tree for the install-lease tests.
type leaseNode struct {
	binDir, confDir, pluginLog string
	chain                      *e2eenv.Chain
	// before is the bin and conf dirs before the install.
	before map[string]string
	ds     *unstructured.Unstructured
	// env is the agents' extra environment (settings through their
	// variables, which an older binary ignores instead of refusing).
	env []string
}

func newLeaseNode(t *testing.T) *leaseNode {
	t.Helper()
	root := t.TempDir()
	n := &leaseNode{binDir: filepath.Join(root, "opt/cni/bin"), pluginLog: filepath.Join(root, "ambientd-cni.log")}
	chain, err := e2eenv.NewChain(e2eenv.ChainConfig{
		BinDirs: []string{n.binDir, testEnv.Bins.CNIRefDir}, Dir: filepath.Join(root, "cni"),
		NetworkName: "lease", Bridge: "amblease0", Subnet: netip.MustParsePrefix("10.88.77.0/24"), RuntimeConfDir: filepath.Join(root, "cni", "conf"),
	})
	if err != nil {
		t.Fatal(err)
	}
	n.chain, n.confDir = chain, filepath.Dir(chain.ConflistPath)
	if err := os.MkdirAll(n.binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// Another CNI's binary, which must survive everything.
	if err := os.WriteFile(filepath.Join(n.binDir, "other-cni"), []byte("#!/bin/sh\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	n.before = n.snapshot(t)
	return n
}

// newInstalledNode is a lease node with deploy/'s DaemonSet (the
// installation stays), a ztunnel emulator and an ambient namespace.
func newInstalledNode(t *testing.T, ctx context.Context, name string) (*leaseNode, string) {
	t.Helper()
	n := newLeaseNode(t)
	n.withDaemonSet(t, ctx)
	startEmulator(t, ctx, "ztunnel-"+name)
	ns := uniqueNS(name)
	createNamespace(t, ctx, ns, true)
	return n, ns
}

// snapshot is every file of the bin and conf dirs with its text.
func (n *leaseNode) snapshot(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, dir := range []string{n.binDir, n.confDir} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			out[filepath.Join(dir, e.Name())] = string(b)
		}
	}
	return out
}

// asBefore fails the test unless the bin and conf dirs are as before the
// install.
func (n *leaseNode) asBefore(t *testing.T) {
	t.Helper()
	now := n.snapshot(t)
	for p, was := range n.before {
		if is, ok := now[p]; !ok || is != was {
			t.Errorf("%s: changed or removed since before the install (present: %v)", p, ok)
		}
	}
	for p := range now {
		if _, ok := n.before[p]; !ok {
			t.Errorf("%s: left behind (not there before the install)", p)
		}
	}
}

func (n *leaseNode) leasePath() string {
	return filepath.Join(n.binDir, cniapi.PluginType+cniapi.LeaseSuffix)
}

func (n *leaseNode) lease(t *testing.T) cniapi.InstallLease {
	t.Helper()
	b, err := os.ReadFile(n.leasePath())
	if err != nil {
		t.Fatalf("install lease: %v", err)
	}
	var l cniapi.InstallLease
	if err := json.Unmarshal(b, &l); err != nil {
		t.Fatalf("install lease %s: %v", b, err)
	}
	return l
}

// installed: our config is what the runtime uses and the binary is there.
func (n *leaseNode) installed() bool {
	if daemon.PluginInConfDir(n.confDir, cniapi.PluginType) != nil {
		return false
	}
	_, err := os.Stat(filepath.Join(n.binDir, cniapi.PluginType))
	return err == nil
}

// withDaemonSet creates deploy/'s DaemonSet (it selects this node): the
// agent's shutdown rule sees an installation that stays.
func (n *leaseNode) withDaemonSet(t *testing.T, ctx context.Context) {
	t.Helper()
	n.ds = applyAgentDaemonSet(t, ctx)
}

// deleteDaemonSet deletes it and waits until it is gone.
func (n *leaseNode) deleteDaemonSet(t *testing.T, ctx context.Context) {
	t.Helper()
	deleteAgentDaemonSet(t, ctx, n.ds)
}

// start runs bin/ambientd --install-cni on this tree (extra flags last) and
// waits until it installed the plugin and serves its CNI socket.
func (n *leaseNode) start(t *testing.T, ctx context.Context, name string, extra ...string) *e2eenv.Agent {
	t.Helper()
	a := n.spawn(t, ctx, name, extra...)
	if err := a.WaitLive(ctx); err != nil {
		t.Fatalf("%s not live: %v\n%s", name, err, a.LogTail(40))
	}
	testutil.Eventually(t, name+" installed the plugin", time.Minute, n.installed)
	waitCNIServing(t, ctx)
	return a
}

// spawn starts the agent without waiting for anything.
func (n *leaseNode) spawn(t *testing.T, ctx context.Context, name string, extra ...string) *e2eenv.Agent {
	t.Helper()
	args := append([]string{"--install-cni", "--cni-bin-dir=" + n.binDir, "--cni-conf-dir=" + n.confDir,
		"--cni-bin-source=" + testEnv.Bins.CNIPlugin, "--daemonset-namespace=" + e2eenv.AgentNamespace,
		"--cni-plugin-log-file=" + n.pluginLog}, extra...)
	a, err := testEnv.StartAgent(ctx, e2eenv.AgentConfig{Name: name, Args: args, Env: n.env})
	if err != nil {
		t.Fatal(err)
	}
	a.LogOnFailure(t)
	t.Cleanup(func() { _ = a.Stop(10 * time.Second) })
	return a
}

// kill SIGKILLs the agent and waits for its exit.
func kill(t *testing.T, a *e2eenv.Agent) {
	t.Helper()
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
}

// tryPod creates a pod through the runtime chain; the pod is deleted when
// the test ends.
func (n *leaseNode) tryPod(t *testing.T, ctx context.Context, namespace, name string) (*e2eenv.Pod, error) {
	t.Helper()
	p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: namespace, Name: name, Chain: n.chain})
	if err == nil {
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := testEnv.DeletePod(cctx, p); err != nil {
				t.Errorf("delete pod %s/%s: %v", p.Namespace, p.Name, err)
			}
		})
	}
	return p, err
}

// waitsForAgent fails the test unless a new pod's ADD fails closed the way
// it does while the agent restarts: "agent unreachable", try again later.
func (n *leaseNode) waitsForAgent(t *testing.T, ctx context.Context, namespace, name, why string) {
	t.Helper()
	_, err := n.tryPod(t, ctx, namespace, name)
	cerr, ok := e2eenv.IsCNIError(err)
	if !ok || cerr.Code != 11 || !strings.Contains(cerr.Msg, "agent unreachable") {
		t.Fatalf("%s: new pod %s/%s: %v; want the ADD to fail closed (code 11, agent unreachable)\nplugin log:\n%s", why, namespace, name, err, lastLines(n.pluginLogText(), 20))
	}
	if !n.installed() {
		t.Fatalf("%s: the plugin is no longer installed after a failed-closed ADD", why)
	}
	t.Logf("%s: %s/%s waits for the agent: %s", why, namespace, name, cerr.Msg)
}

// startsWithoutAgent fails the test unless a new pod starts while no agent runs.
func (n *leaseNode) startsWithoutAgent(t *testing.T, ctx context.Context, namespace, name string) {
	t.Helper()
	if _, err := n.tryPod(t, ctx, namespace, name); err != nil {
		t.Fatalf("new pod %s/%s with no agent: %v\nplugin log:\n%s", namespace, name, err, lastLines(n.pluginLogText(), 20))
	}
}

func (n *leaseNode) pluginLogText() string {
	b, _ := os.ReadFile(n.pluginLog)
	return string(b)
}

// TestUnfinishedUninstallSIGKILL: the operator uninstalls (the DaemonSet
// deleted); the agent, told to stop, decides to uninstall and hands the
// node over (--handover istio), and is SIGKILLed right after its decision,
// before it could remove anything (an OOM kill, a node going down, a
// kubelet that ran out of grace). A new pod in `default` then starts with
// no manual step: the plugin, finding no agent and a lease marked
// uninstalling, finishes the uninstall; the bin and conf dirs are as
// before the install.
func TestUnfinishedUninstallSIGKILL(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	startEmulator(t, ctx, "ztunnel-lease-kill")
	// The kill lands between the decision and the removal (the handover
	// takes a few iptables runs) unless this process is not scheduled in
	// time on a loaded machine: then the agent finished, and the scenario
	// runs again on a fresh tree.
	var n *leaseNode
	for attempt := 1; ; attempt++ {
		n = newLeaseNode(t)
		n.withDaemonSet(t, ctx)
		a := n.start(t, ctx, fmt.Sprintf("agent-lease-kill-%d", attempt), "--handover=istio")
		n.deleteDaemonSet(t, ctx)

		// Kill the agent the moment it says it decided to uninstall and
		// starts the handover.
		if err := a.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		decided := false
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline) && !decided; {
			decided = strings.Contains(a.Logs(), "uninstalling with a handover")
			time.Sleep(time.Millisecond)
		}
		kill(t, a)
		if !decided {
			t.Fatalf("the agent never decided to uninstall:\n%s", a.LogTail(30))
		}
		if n.installed() {
			break
		}
		if attempt == 3 {
			t.Fatalf("in %d attempts the agent always finished its uninstall before the kill; nothing to recover:\n%s", attempt, a.LogTail(30))
		}
		t.Logf("attempt %d: the agent finished its uninstall before the kill; again", attempt)
	}
	t.Logf("agent SIGKILLed after deciding to uninstall")

	n.startsWithoutAgent(t, ctx, "default", "after-kill")
	n.asBefore(t)
	if log := n.pluginLogText(); !strings.Contains(log, "finished the uninstall the agent left") {
		t.Errorf("the plugin did not log the recovery:\n%s", lastLines(log, 20))
	}
	// And the runtime no longer calls us at all.
	n.startsWithoutAgent(t, ctx, "default", "after-kill-2")
}

// TestUnfinishedUninstallReboot: the node goes down while the operator
// uninstalls — the agent killed before it saw anything (no decision, lease
// state installed), the DaemonSet deleted while the node is away, so no
// agent ever starts on it again. Within the lease's TTL a pod outside the
// mesh starts and leaves the plugin in place (nothing proves an uninstall
// yet, and it does not ask); a mesh pod's ADD asks the API, which says the
// DaemonSet is gone: the plugin finishes the uninstall and the pod starts,
// and the bin and conf dirs are as before, with no manual step.
func TestUnfinishedUninstallReboot(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	n, ambient := newInstalledNode(t, ctx, "lease-reboot")
	a := n.start(t, ctx, "agent-lease-reboot")
	kill(t, a)
	n.deleteDaemonSet(t, ctx)
	n.startsWithoutAgent(t, ctx, "default", "plain-first")
	if !n.installed() {
		t.Fatalf("a pod outside the mesh, within the lease's TTL, uninstalled the plugin:\n%s", lastLines(n.pluginLogText(), 10))
	}
	n.startsWithoutAgent(t, ctx, ambient, "after-reboot")
	n.asBefore(t)
	if log := n.pluginLogText(); !strings.Contains(log, "does not exist: the agent was uninstalled and nobody finished it") ||
		!strings.Contains(log, "finished the uninstall the agent left") {
		t.Errorf("the plugin did not log why:\n%s", lastLines(log, 20))
	}
}

// TestNoRecoveryWhileTheAgentIsComing: everything that takes the agent away
// while it stays installed leaves the plugin failing closed — new ambient
// pods wait for the agent ("agent unreachable") and start once an agent is
// back: an agent SIGKILLed while its DaemonSet exists, an agent
// crash-looping for longer than the TTL, a node rebooted with ambientd
// installed whose lease was last renewed long before the boot, an agent
// stopped during an API outage, and a lease that is garbage, world-writable
// or from an unknown version.
func TestNoRecoveryWhileTheAgentIsComing(t *testing.T) {
	ctx := testutil.Context(t, 8*time.Minute)
	n := newLeaseNode(t)
	n.withDaemonSet(t, ctx)
	ns := uniqueNS("lease-closed")
	createNamespace(t, ctx, ns, true)
	startEmulator(t, ctx, "ztunnel-lease-closed")
	backAgain := func(what string, extra ...string) {
		t.Helper()
		a := n.start(t, ctx, "agent-lease-back-"+what, extra...)
		p, err := n.tryPod(t, ctx, ns, "back-"+what)
		if err != nil {
			t.Fatalf("%s: new ambient pod with the agent back: %v", what, err)
		}
		waitAnnotation(t, ctx, p, "enabled")
		kill(t, a)
	}

	t.Run("SIGKILL while the DaemonSet exists", func(t *testing.T) {
		a := n.start(t, ctx, "agent-lease-sigkill")
		kill(t, a)
		n.waitsForAgent(t, ctx, ns, "sigkill", "agent SIGKILLed")
		backAgain("sigkill")
	})

	t.Run("crash loop longer than the TTL", func(t *testing.T) {
		// Every start renews the lease first thing: a crash loop whose
		// restarts come more often than the TTL (kubelet's backoff caps at
		// 5 minutes, the default TTL is 10) keeps the plugin closed. Here:
		// TTL 5s, a start every second or two, killed at once or exiting
		// on a refused setting, for 3 TTLs.
		const ttl = 5 * time.Second
		n.env = []string{"AMBIENTD_CNI_INSTALL_LEASE_TTL=" + ttl.String()}
		defer func() { n.env = nil }()
		a := n.start(t, ctx, "agent-lease-loop-0")
		kill(t, a)
		for i, end := 1, time.Now().Add(3*ttl); time.Now().Before(end); i++ {
			before := n.lease(t).Renewed
			env := n.env
			if i%2 == 1 {
				// A setting refused at start (exit code 2): the lease is
				// renewed before that.
				n.env = append(slices.Clone(env), "AMBIENTD_POD_LOOKUP_TIMEOUT=10m")
			}
			a := n.spawn(t, ctx, "agent-lease-loop")
			n.env = env
			testutil.Eventually(t, "the restarted agent renewed its lease", 10*time.Second, func() bool {
				b, err := os.ReadFile(n.leasePath())
				var l cniapi.InstallLease
				return err == nil && json.Unmarshal(b, &l) == nil && l.Renewed.After(before)
			})
			kill(t, a)
			if i%2 == 0 {
				n.waitsForAgent(t, ctx, ns, "loop-"+time.Now().Format("150405000"), "agent crash-looping")
			}
			time.Sleep(time.Second)
		}
		n.waitsForAgent(t, ctx, ns, "loop-end", "after a crash loop of 3 TTLs")
		backAgain("loop")
	})

	t.Run("reboot with ambientd installed", func(t *testing.T) {
		// The TTL counts from the boot when the lease is older: the node
		// was down for an hour, its agent's lease renewed before that.
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err != nil {
			t.Fatal(err)
		}
		uptime := time.Duration(si.Uptime) * time.Second
		boot := time.Now().Add(-uptime)
		ttl := (uptime + 5*time.Minute).Round(time.Second)
		n.env = []string{"AMBIENTD_CNI_INSTALL_LEASE_TTL=" + ttl.String()}
		defer func() { n.env = nil }()
		a := n.start(t, ctx, "agent-lease-boot")
		kill(t, a)
		l := n.lease(t)
		l.Renewed = boot.Add(-time.Hour)
		writeLease(t, n.leasePath(), l, 0o644)
		t.Logf("lease renewed %s, before the boot at %s; ttl %v: expired counted from the renewal, not from the boot", l.Renewed.Format(time.RFC3339), boot.Format(time.RFC3339), ttl)
		n.waitsForAgent(t, ctx, ns, "boot", "rebooted node, agent not started yet")
		backAgain("boot")
	})

	t.Run("API outage", func(t *testing.T) {
		a := n.start(t, ctx, "agent-lease-outage")
		cont := pauseAPIServer(t)
		// The agent stopped during the outage cannot tell an uninstall
		// from a restart: it keeps everything, the lease stays installed.
		if err := a.Stop(60 * time.Second); err != nil {
			t.Fatal(err)
		}
		cont()
		if err := testEnv.CP.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(a.Logs(), "cannot tell uninstall from upgrade") {
			t.Errorf("the agent did not log its doubt at shutdown:\n%s", a.LogTail(20))
		}
		if l := n.lease(t); l.State != cniapi.LeaseInstalled {
			t.Fatalf("lease after a stop during an API outage: %+v, want installed", l)
		}
		n.waitsForAgent(t, ctx, ns, "outage", "agent stopped during an API outage")
		backAgain("outage")
	})

	t.Run("untrusted lease", func(t *testing.T) {
		n.env = []string{"AMBIENTD_CNI_INSTALL_LEASE_TTL=2s"}
		defer func() { n.env = nil }()
		a := n.start(t, ctx, "agent-lease-garbage")
		kill(t, a)
		good := n.lease(t)
		good.State = cniapi.LeaseUninstalling // what would open the path
		for _, c := range []struct {
			name, want string
			write      func()
		}{
			{"garbage", "not valid JSON", func() {
				if err := os.WriteFile(n.leasePath(), []byte("\x7fELF garbage {\"state\":\"uninstalling\""), 0o644); err != nil {
					t.Fatal(err)
				}
			}},
			{"world-writable", "writable by group or others", func() { writeLease(t, n.leasePath(), good, 0o666) }},
			{"unknown-version", "has version 99", func() {
				l := good
				l.Version = 99
				writeLease(t, n.leasePath(), l, 0o644)
			}},
		} {
			c.write()
			n.waitsForAgent(t, ctx, ns, "lease-"+c.name, "lease "+c.name)
			if log := n.pluginLogText(); !strings.Contains(log, c.want) {
				t.Errorf("lease %s: the plugin log does not say %q:\n%s", c.name, c.want, lastLines(log, 10))
			}
		}
		backAgain("garbage")
	})
}

// writeLease writes l to path with mode, as a (mis)configured writer would.
func writeLease(t *testing.T, path string, l cniapi.InstallLease, mode os.FileMode) {
	t.Helper()
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil { // past the umask
		t.Fatal(err)
	}
}
