package main

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/shutdownrule"
	"github.com/ambientd/ambientd/test/infra/testutil"

	"github.com/ambientd/ambientd/test/infra/kubetest"
)

// TestHandOverAtUninstall is the wiring of `ambientd run --handover istio`
// on a throwaway node (a netns) with one pod (another netns) enrolled by
// ambientd's default backend, nftables: at an uninstall (the DaemonSet is
// gone) the agent's HandOver removes our host rules, returns a manager for
// the backend Istio's agent will use — iptables-nft on this clean node —
// into which the pod's rules move (and nothing stays in nftables); Finish
// then uninstalls and forgets the sticky backend choice. At an upgrade (the
// DaemonSet still selects the node) nothing is handed over and everything
// stays.
func TestHandOverAtUninstall(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "nft", "iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save")
	for _, upgrade := range []bool{false, true} {
		name := map[bool]string{false: "uninstall", true: "upgrade"}[upgrade]
		t.Run(name, func(t *testing.T) { testHandOver(t, upgrade) })
	}
}

func testHandOver(t *testing.T, upgrade bool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	log := testutil.Logger(t, slog.LevelInfo)
	node, pod := testutil.NewNetNS(t).NS, testutil.NewNetNS(t).NS
	root := t.TempDir()
	bin, conf, src, state := filepath.Join(root, "bin"), filepath.Join(root, "net.d"), filepath.Join(root, "ambientd-cni"), filepath.Join(root, "run")
	for _, d := range []string{bin, conf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(src, []byte("plugin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(conf, "10-calico.conflist"), []byte(`{"cniVersion":"1.0.0","name":"k","plugins":[{"type":"calico"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}}, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "istio-system"}})
	if upgrade {
		if _, err := client.AppsV1().DaemonSets("istio-system").Create(ctx, &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "ambientd", Namespace: "istio-system"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var (
		ci       *daemon.InstallCNI
		inst     *cniinstall.Installer
		shutdown *shutdownrule.Rule
	)
	var ours *iptables.Manager
	inNS(t, node, func() error {
		var err error
		ours, err = iptables.NewManager(ctx, iptables.Config{IPv6: true, StateDir: state, KubeletUID: new(uint32)}, log)
		if err != nil {
			return err
		}
		if ours.Mode() != iptables.ModeNFTables {
			t.Fatalf("our backend on a clean node: %s, want nftables", ours.Mode())
		}
		if err := ours.EnsureHostRules(ctx); err != nil {
			return err
		}
		inst, err = cniinstall.New(cniinstall.Config{BinSource: src, BinDir: bin, ConfDir: conf, Entry: cniinstall.Entry{Type: "ambientd-cni"}}, log)
		if err != nil {
			return err
		}
		shutdown = shutdownrule.New(kubetest.Wrap(client), "istio-system", "ambientd", "n1")
		ci = daemon.NewInstallCNI(inst, shutdown, ours, iptables.SuccessorIstio, log)
		_, err = inst.Install()
		return err
	})
	if err := ours.ApplyPod(ctx, pod, iptables.PodOptions{DNSCapture: true}); err != nil {
		t.Fatal(err)
	}
	if err := shutdown.Probe(ctx); err != nil {
		t.Fatal(err)
	}

	var successor *iptables.Manager
	inNS(t, node, func() error {
		to, err := ci.HandOver(ctx)
		if to != nil {
			successor = to.(*iptables.Manager)
		}
		return err
	})
	if upgrade {
		if successor != nil {
			t.Fatalf("handed over at an upgrade (to %s)", successor.Mode())
		}
		if out := nsOut(t, node, "nft", "list", "tables"); !strings.Contains(out, "istio-ambient-nat") {
			t.Errorf("host rules removed at an upgrade:\n%s", out)
		}
		inNS(t, node, func() error { return ci.Finish() })
		if _, err := os.Stat(filepath.Join(state, "rules-backend")); err != nil {
			t.Errorf("backend choice forgotten at an upgrade: %v", err)
		}
		return
	}
	if successor == nil {
		t.Fatal("no handover at an uninstall")
	}
	if successor.Mode() != iptables.ModeNFT {
		t.Errorf("successor backend %s, want nft (Istio's agent on a node without legacy tables)", successor.Mode())
	}
	if out := nsOut(t, node, "nft", "list", "tables"); strings.Contains(out, "istio-ambient") {
		t.Errorf("our host rules still there when the successor's backend was chosen:\n%s", out)
	}
	if err := successor.ApplyPod(ctx, pod, iptables.PodOptions{DNSCapture: true}); err != nil {
		t.Fatal(err)
	}
	if out := nsOut(t, pod, "nft", "list", "tables"); strings.Contains(out, "istio-ambient") {
		t.Errorf("our nftables tables left in the pod after the handover:\n%s", out)
	}
	for _, save := range []string{"iptables-nft-save", "ip6tables-nft-save"} {
		if out := nsOut(t, pod, save); strings.Count(out, "-j ISTIO_") != 6 {
			t.Errorf("%s in the pod after the handover: want the 6 jumps of one rule set:\n%s", save, out)
		}
	}
	inNS(t, node, func() error { return ci.Finish() })
	if _, err := os.Stat(filepath.Join(state, "rules-backend")); !os.IsNotExist(err) {
		t.Errorf("backend choice kept after a handover uninstall: %v", err)
	}
	if _, err := os.Stat(filepath.Join(bin, "ambientd-cni")); !os.IsNotExist(err) {
		t.Errorf("plugin binary left: %v", err)
	}
}

func inNS(t *testing.T, n ns.NetNS, fn func() error) {
	t.Helper()
	if err := n.Do(func(ns.NetNS) error { return fn() }); err != nil {
		t.Fatal(err)
	}
}

func nsOut(t *testing.T, n ns.NetNS, name string, args ...string) string {
	t.Helper()
	var out []byte
	inNS(t, n, func() error {
		var err error
		out, err = exec.Command(name, args...).CombinedOutput()
		return err
	})
	return string(out)
}
