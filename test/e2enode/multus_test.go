//go:build e2enode

package e2enode

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/multusemu"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// multusOnTheNode: Multus (thin plugin, auto-config; the writer and plugin
// doubles of test/infra/multusemu and test/multus, after multus-cni
// v4.3.0-42-g95a093235) on the node beside the installed agent: its binary
// in the node's CNI bin dir, its writer on the node's conf dir. Multus
// starts (it takes the agent's copy as its master), then restarts
// (regenerates from scratch). Each time, within 10 s no file changes any
// more and none runs Multus inside Multus, and a pod the kubelet starts in
// an ambient namespace goes through Multus (one ADD in Multus's log), is
// enrolled by exactly one CNI ADD of our plugin (the agent's log), and its
// app started captured. When Multus goes (its file with it) the agent's own
// copy is back.
func (r *agentRun) multusOnTheNode(t *testing.T, ctx context.Context) {
	r.ensureInstalled(t, ctx)
	ns := ambientNamespace(t, ctx, "ambient-multus")
	bin, err := os.ReadFile(node.Env.Bins.Multus)
	if err != nil {
		t.Fatal(err)
	}
	multusBin := filepath.Join(node.CNIBinDir, "multus")
	if err := os.WriteFile(multusBin, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(multusBin) })
	work := t.TempDir()
	multusLog := filepath.Join(work, "multus.log")

	runMultus := func() (stop func()) {
		return testutil.Run(t, multusemu.Restarting(func() *multusemu.Thin {
			return &multusemu.Thin{Dir: nodeenv.StdCNIConfDir, Kubeconfig: node.Env.CP.AdminKubeconfig,
				CNIDir: filepath.Join(work, "cache"), LogFile: multusLog}
		}, time.Second, func(err error) { t.Logf("Multus's writer exited, restarting it: %v", err) }))
	}

	check := func(step, name string) {
		t.Helper()
		took, files, err := multusemu.WaitFixedPoint(nodeenv.StdCNIConfDir, 10*time.Second, 3*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		for f, text := range files {
			if multusemu.Nested(multusemu.ExpandText(text)) {
				t.Errorf("%s: %s runs Multus inside Multus:\n%s", step, f, text)
			}
		}
		cfgName, text, err := node.RuntimeConfig()
		if err != nil {
			t.Fatal(err)
		}
		runs := multusemu.ExpandText(text)
		t.Logf("%s: conf dir at a fixed point %s after the step; containerd's config %s runs %v", step, took.Round(time.Millisecond), cfgName, runs)
		if !slices.Contains(runs, "multus(") {
			t.Errorf("%s: containerd's config %s bypasses Multus: %v", step, cfgName, runs)
		}
		created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod(name), metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p, err := waitPod(ctx, ns, name, podReady)
		if err != nil {
			t.Fatalf("%s: %v; %s", step, err, describe(p))
		}
		r.capturedBeforeStart(t, ctx, p)
		b, _ := os.ReadFile(multusLog)
		if n := strings.Count(string(b), "ADD "+ns+"/"+name+" "); n != 1 {
			t.Errorf("%s: Multus ran %d ADDs for %s, want 1 (the kubelet's ADD went through Multus)", step, n, name)
		}
		if n := cniAddsHandled(t, ctx, string(created.UID)); n != 1 {
			t.Errorf("%s: our plugin asked the agent %d times for the ADD of %s, want exactly once", step, n, name)
		}
	}

	stopFirst := runMultus()
	if err := nodeenv.Poll(ctx, "Multus wrote its file", 100*time.Millisecond, func(context.Context) (bool, error) {
		_, err := os.Stat(filepath.Join(nodeenv.StdCNIConfDir, "00-multus.conflist"))
		return err == nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	check("Multus started beside the agent", "multus-first")
	stopFirst()
	stopSecond := runMultus()
	check("Multus restarted", "multus-second")

	// Multus uninstalled: its file goes, the agent's copy of the primary
	// is the runtime's again.
	stopSecond()
	if err := nodeenv.Poll(ctx, "the plugin back in containerd's config without Multus", 100*time.Millisecond, func(context.Context) (bool, error) {
		name, _, err := node.RuntimeConfig()
		return err == nil && !strings.HasPrefix(name, "00-multus") && pluginInstalled(t), nil
	}); err != nil {
		t.Fatalf("%v: %s", err, runtimeConfig(t))
	}
}

// cniAddsHandled counts the agent's answered CNI ADDs for pod uid (its log).
func cniAddsHandled(t *testing.T, ctx context.Context, uid string) int {
	t.Helper()
	logs, err := node.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/ambientd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(logs, "\n") {
		var rec struct {
			Msg string `json:"msg"`
			UID string `json:"uid"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.UID == uid && rec.Msg == "CNI ADD handled" {
			n++
		}
	}
	return n
}
