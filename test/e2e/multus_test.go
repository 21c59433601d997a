//go:build e2e

package e2e

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/multusemu"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// TestMultusPodAddRunsOurPluginOnce: a node with Multus (thin plugin,
// auto-config) beside the agent in owned mode — Multus's writer
// (test/infra/multusemu Thin) and its plugin binary (bin/multus), both
// following multus-cni v4.3.0-42-g95a093235 — and the container runtime's
// part played by libcni on whatever config the runtime would choose in the
// conf dir. Multus starts after the agent (it takes our copy as its
// master), a pod is added; Multus restarts (removes its file, regenerates
// from scratch), a pod is added. Each time: within 10 s no file changes
// any more, no config runs Multus inside Multus, the runtime's config runs
// Multus, and the pod's ADD went through Multus and ran our plugin exactly
// once (the plugin's own log), and the pod is enrolled and captured.
func TestMultusPodAddRunsOurPluginOnce(t *testing.T) {
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	for _, d := range []string{binDir, confDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The node's primary network: a bridge of its own, so its leases and
	// addresses never meet the environment's chain.
	chain, err := e2eenv.NewChain(e2eenv.ChainConfig{
		BinDirs: []string{binDir, testEnv.Bins.CNIRefDir}, Dir: filepath.Join(root, "cni"),
		NetworkName: "k8s-pod-network", Bridge: "ambmul0", Subnet: netip.MustParsePrefix("10.89.0.0/24"),
		RuntimeConfDir: confDir,
	})
	if err != nil {
		t.Fatal(err)
	}
	primary, err := os.ReadFile(chain.ConflistPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(confDir, "10-bridge.conflist"), primary, 0o644); err != nil {
		t.Fatal(err)
	}
	// Multus's thin entrypoint copies its binary into the node's bin dir.
	multusBin, err := os.ReadFile(testEnv.Bins.Multus)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(binDir, "multus"), multusBin, 0o755); err != nil {
		t.Fatal(err)
	}

	pluginLog, multusLog := filepath.Join(root, "ambientd-cni.log"), filepath.Join(root, "multus.log")
	s := newScenario(t, "multus", agentArgs("--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace,
		"--cni-plugin-log-file="+pluginLog))
	ctx := s.ctx

	runMultus := func() (stop func()) {
		return testutil.Run(t, multusemu.Restarting(func() *multusemu.Thin {
			return &multusemu.Thin{Dir: confDir, Kubeconfig: testEnv.CP.AdminKubeconfig, BinDir: binDir,
				CNIDir: filepath.Join(root, "multus"), LogFile: multusLog}
		}, time.Second, func(err error) { t.Logf("Multus's writer exited, restarting it: %v", err) }))
	}

	check := func(step, pod string) {
		t.Helper()
		took, files, err := multusemu.WaitFixedPoint(confDir, 10*time.Second, 3*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		t.Logf("%s: conf dir at a fixed point %s after the step", step, took.Round(time.Millisecond))
		for name, text := range files {
			if multusemu.Nested(multusemu.ExpandText(text)) {
				t.Errorf("%s: %s runs Multus inside Multus:\n%s", step, name, text)
			}
		}
		rc, err := cniinstall.RuntimeConfig(confDir)
		if err != nil {
			t.Fatal(err)
		}
		runs := multusemu.ExpandText(string(rc.Data))
		t.Logf("%s: the runtime's config %s runs %v", step, filepath.Base(rc.Path), runs)
		if !slices.Contains(runs, "multus(") {
			t.Errorf("%s: the runtime's config %s bypasses Multus: %v\n%s", step, rc.Path, runs, multusemu.Dump(files))
		}

		p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: pod, Chain: chain})
		waitAnnotation(t, ctx, p, "enabled")
		waitEmu(t, ctx, s.em, "workload "+pod, func(st ztunnelemu.State) bool {
			w, ok := st.Workload(p.UID)
			return ok && w.NetnsInode == netnsInode(t, p)
		})
		dst := netip.AddrPortFrom(netip.MustParseAddr("10.89.0.250"), 9080).String()
		if c, err := p.Dial(ctx, "tcp", dst); err != nil {
			t.Fatalf("%s: dial from the pod: %v", step, err)
		} else {
			c.Close()
		}
		waitEmu(t, ctx, s.em, "outbound connection of "+pod+" on 15001", func(st ztunnelemu.State) bool {
			return slices.ContainsFunc(st.Accepted, func(a ztunnelemu.AcceptRecord) bool {
				return a.UID == p.UID && a.Port == 15001 && a.OrigDst == dst
			})
		})
		if n := countLines(t, multusLog, "ADD "+s.ns+"/"+pod+" "); n != 1 {
			t.Errorf("%s: Multus ran %d ADDs for %s, want 1 (the runtime's ADD went through Multus)", step, n, pod)
		}
		if n := countLines(t, pluginLog, `msg="agent answered"`, "cmd=ADD", "pod="+pod+" "); n != 1 {
			t.Errorf("%s: our plugin ran %d times for the ADD of %s, want exactly once", step, n, pod)
		}
	}

	stopFirst := runMultus()
	testutil.Eventually(t, "Multus wrote its file", 10*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(confDir, "00-multus.conflist"))
		return err == nil
	})
	check("Multus started beside the agent", "first")

	// Multus restarts: it removes its file as it exits, and the new one
	// regenerates from scratch (it keeps no state).
	stopFirst()
	runMultus()
	check("Multus restarted", "second")
}

// countLines counts the lines of file that contain every one of words.
func countLines(t *testing.T, file string, words ...string) int {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if !slices.ContainsFunc(words, func(w string) bool { return !strings.Contains(line, w) }) {
			n++
		}
	}
	return n
}
