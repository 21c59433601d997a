package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestUninstall installs for real in a throwaway "node" (a netns for the
// host rules of both families, as `ambientd run` makes them by default, and
// a temp dir for the CNI dirs), runs `ambientd uninstall` there with its
// defaults, and checks everything of ours is gone — IPv6 rules and set too —
// and nothing else changed.
func TestUninstall(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "iptables-legacy-save", "iptables-nft-save", "ip6tables-legacy-save", "ip6tables-nft-save", "ipset")
	for _, mode := range []string{"legacy", "nft"} {
		t.Run(mode, func(t *testing.T) { testUninstall(t, mode) })
	}
}

func testUninstall(t *testing.T, mode string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	node := testutil.NewNetNS(t).NS
	root := t.TempDir()
	bin, conf, src := filepath.Join(root, "bin"), filepath.Join(root, "net.d"), filepath.Join(root, "ambientd-cni")
	for _, d := range []string{bin, conf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(src, []byte("plugin"), 0o755); err != nil {
		t.Fatal(err)
	}
	original := `{"cniVersion":"1.0.0","name":"k","plugins":[{"type":"calico"},{"type":"istio-cni"}]}` + "\n"
	if err := os.WriteFile(filepath.Join(conf, "10-calico.conflist"), []byte(original), 0o644); err != nil {
		t.Fatal(err)
	}
	inst, err := cniinstall.New(cniinstall.Config{BinSource: src, BinDir: bin, ConfDir: conf, Entry: cniinstall.Entry{Type: "ambientd-cni"}}, testutil.Logger(t, slog.LevelInfo))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	save := "iptables-" + mode + "-save"
	var before string
	err = node.Do(func(ns.NetNS) error {
		m, err := iptables.NewManager(ctx, iptables.Config{Mode: iptables.Mode(mode), IPv6: iptables.DefaultIPv6}, testutil.Logger(t, slog.LevelInfo))
		if err != nil {
			return err
		}
		if err := m.EnsureHostRules(ctx); err != nil {
			return err
		}
		for _, s := range []string{save, "ip6" + strings.TrimPrefix(save, "ip")} {
			out, err := exec.CommandContext(ctx, s, "-t", "nat").CombinedOutput()
			before += string(out)
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Count(before, ":ISTIO_POSTRT") != 2 {
		t.Fatalf("host rules of both families not installed:\n%s", before)
	}

	var stderr bytes.Buffer
	var code int
	var after, sets string
	err = node.Do(func(ns.NetNS) error {
		code = runUninstall(ctx, []string{"--cni-bin-dir", bin, "--cni-conf-dir", conf},
			func(k string) string { return map[string]string{"AMBIENTD_IPTABLES": mode}[k] }, &stderr)
		for _, s := range []string{save, "ip6" + strings.TrimPrefix(save, "ip")} {
			out, err := exec.CommandContext(ctx, s, "-t", "nat").CombinedOutput()
			after += string(out)
			if err != nil {
				return err
			}
		}
		out, err := exec.CommandContext(ctx, "ipset", "list", "-n").CombinedOutput()
		sets = string(out)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if code != 0 {
		t.Fatalf("ambientd uninstall exited %d:\n%s", code, stderr.String())
	}
	if strings.Contains(after, "ISTIO_POSTRT") || strings.Contains(sets, "istio-inpod-probes") {
		t.Fatalf("host rules or probe sets left:\n%s\n%s", after, sets)
	}
	if b, _ := os.ReadFile(filepath.Join(conf, "10-calico.conflist")); string(b) != original {
		t.Fatalf("config not restored byte for byte (istio-cni's entry must stay):\n%s", b)
	}
	if _, err := os.Stat(filepath.Join(bin, "ambientd-cni")); !os.IsNotExist(err) {
		t.Fatalf("plugin binary left: %v", err)
	}
	// Again: nothing left to remove is fine.
	stderr.Reset()
	_ = node.Do(func(ns.NetNS) error {
		code = runUninstall(ctx, []string{"--cni-bin-dir", bin, "--cni-conf-dir", conf, "--iptables", mode}, func(string) string { return "" }, &stderr)
		return nil
	})
	if code != 0 {
		t.Fatalf("second uninstall exited %d:\n%s", code, stderr.String())
	}
}

func TestUninstallBadFlags(t *testing.T) {
	for _, args := range [][]string{{"--iptables=both"}, {"--cni-conf-dir=rel"}, {"--timeout=0s"}, {"extra"}} {
		var stderr bytes.Buffer
		if code := runUninstall(context.Background(), args, func(string) string { return "" }, &stderr); code != 2 || stderr.Len() == 0 {
			t.Errorf("%v: exit %d, stderr %q", args, code, stderr.String())
		}
	}
}
