package iptables

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
)

// autoIn runs NewManager with ModeAuto inside node and returns the mode.
func autoIn(t *testing.T, node ns.NetNS, stateDir string) Mode {
	t.Helper()
	var got Mode
	inNode(t, node, "NewManager(auto)", func() error {
		m, err := NewManager(testCtx(t), Config{StateDir: stateDir, KubeletUID: uidPtr(0)}, slog.New(slog.DiscardHandler))
		if err == nil {
			got = m.Mode()
		}
		return err
	})
	return got
}

// TestAutoChoice: auto picks nftables only on a node where no iptables rules
// of ours exist (host chain or probe ipsets) — never mixing backends on one
// node — and otherwise stays with the backend that holds ours.
func TestAutoChoice(t *testing.T) {
	requireNFT(t)
	hostRulesOf := func(mode Mode) func(*testing.T, ns.NetNS) {
		return func(t *testing.T, node ns.NetNS) {
			m := newTestManager(t, mode, Config{KubeletUID: uidPtr(0)})
			inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(testCtx(t)) })
		}
	}
	tests := []struct {
		name  string
		setup func(*testing.T, ns.NetNS)
		want  Mode
	}{
		{"clean node", func(*testing.T, ns.NetNS) {}, ModeNFTables},
		{"others' legacy rules only (kube-proxy)", func(t *testing.T, node ns.NetNS) {
			for i := range 3 {
				nsRun(t, node, tool(IPv4, ModeLegacy, ""), "-w", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", fmt.Sprint(1000+i), "-j", "ACCEPT")
			}
		}, ModeNFTables},
		{"our host rules in iptables-legacy", hostRulesOf(ModeLegacy), ModeLegacy},
		{"our host rules in iptables-nft", hostRulesOf(ModeNFT), ModeNFT},
		{"our host rules in nftables", hostRulesOf(ModeNFTables), ModeNFTables},
		{"our probe ipsets only", func(t *testing.T, node ns.NetNS) {
			nsRun(t, node, "ipset", "create", ProbeSetV4, "hash:ip", "comment")
		}, ModeNFT},
		{"ours in iptables-legacy and nftables: stay on iptables", func(t *testing.T, node ns.NetNS) {
			hostRulesOf(ModeLegacy)(t, node)
			hostRulesOf(ModeNFTables)(t, node)
		}, ModeLegacy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := newNS(t)
			tt.setup(t, node)
			if got := autoIn(t, node, ""); got != tt.want {
				t.Fatalf("auto chose %q, want %q", got, tt.want)
			}
		})
	}
}

// TestStickyBackend: the choice is persisted in StateDir and survives
// restarts even when the node changes underneath; an explicit mode is
// persisted too; a state file written for another namespace, or garbage, is
// ignored.
func TestStickyBackend(t *testing.T) {
	requireNFT(t)
	dir := t.TempDir()
	node := newNS(t)
	if got := autoIn(t, node, dir); got != ModeNFTables {
		t.Fatalf("first start on a clean node: %q, want nftables", got)
	}
	b, err := os.ReadFile(filepath.Join(dir, stateFile))
	if err != nil || !strings.HasPrefix(string(b), "nftables netns=") {
		t.Fatalf("state file: %q, %v", b, err)
	}

	// Someone left legacy host rules of ours: a restart still keeps nftables.
	legacy := newTestManager(t, ModeLegacy, Config{})
	inNode(t, node, "legacy EnsureHostRules", func() error { return legacy.EnsureHostRules(testCtx(t)) })
	if got := autoIn(t, node, dir); got != ModeNFTables {
		t.Fatalf("restart: %q, want the persisted nftables", got)
	}

	// An explicit mode wins and is what later auto starts keep.
	inNode(t, node, "NewManager(legacy)", func() error {
		_, err := NewManager(testCtx(t), Config{Mode: ModeLegacy, StateDir: dir}, nil)
		return err
	})
	if got := autoIn(t, node, dir); got != ModeLegacy {
		t.Fatalf("after an explicit legacy start: %q, want legacy", got)
	}

	// Another namespace sharing the directory does not follow it.
	other := newNS(t)
	if got := autoIn(t, other, dir); got != ModeNFTables {
		t.Fatalf("other namespace: %q, want nftables (clean node)", got)
	}
	// Garbage is ignored (the node's own rules decide: legacy).
	if err := os.WriteFile(filepath.Join(dir, stateFile), []byte("xtables\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := autoIn(t, node, dir); got != ModeLegacy {
		t.Fatalf("garbage state: %q, want legacy from the node's rules", got)
	}
}

// TestOtherBackendPodRules: a pod holding our rules in another backend (the
// backend changed, or Istio's agent enrolled it in another mode) is reported
// by VerifyPod, moved by ApplyPod and cleaned by DeletePod — never left
// redirecting.
func TestOtherBackendPodRules(t *testing.T) {
	requireNFT(t)
	ctx := testCtx(t)
	pairs := []struct{ old, cur Mode }{
		{ModeLegacy, ModeNFTables}, {ModeNFT, ModeNFTables}, {ModeNFTables, ModeNFT}, {ModeLegacy, ModeNFT}, {ModeNFT, ModeLegacy},
	}
	holds := func(t *testing.T, pod ns.NetNS, mode Mode) bool {
		if mode == ModeNFTables {
			return nftList(t, pod, nftables.PodTables()...) != ""
		}
		return strings.Contains(saveText(t, pod, IPv4, mode), "ISTIO_")
	}
	for _, p := range pairs {
		t.Run(string(p.old)+"->"+string(p.cur), func(t *testing.T) {
			old := newTestManager(t, p.old, Config{})
			cur := newTestManager(t, p.cur, Config{})
			for _, op := range []string{"apply", "delete"} {
				pod := newNS(t)
				if err := old.ApplyPod(ctx, pod, PodOptions{}); err != nil {
					t.Fatal(err)
				}
				if op == "delete" {
					if err := cur.DeletePod(ctx, pod); err != nil {
						t.Fatal(err)
					}
					if holds(t, pod, p.old) || holds(t, pod, p.cur) {
						t.Fatalf("rules left after DeletePod")
					}
					continue
				}
				d, err := cur.VerifyPod(ctx, pod, PodOptions{})
				if err != nil || !strings.Contains(d.String(), "unexpected: "+string(p.old)+": our in-pod rules present") {
					t.Fatalf("VerifyPod does not report the other backend's rules: %v\n%s", err, d)
				}
				if err := cur.ApplyPod(ctx, pod, PodOptions{}); err != nil {
					t.Fatal(err)
				}
				if holds(t, pod, p.old) || !holds(t, pod, p.cur) {
					t.Fatalf("ApplyPod did not move the pod from %s to %s", p.old, p.cur)
				}
				if d, err := cur.VerifyPod(ctx, pod, PodOptions{}); err != nil || !d.Empty() {
					t.Fatalf("VerifyPod after the move: %v %s", err, d)
				}
			}
		})
	}
}

// TestNFTablesSpawnsNothing: the nftables backend starts no process for any
// pod or host operation.
func TestNFTablesSpawnsNothing(t *testing.T) {
	requireNFT(t)
	ctx := testCtx(t)
	m := newTestManager(t, ModeNFTables, Config{IPv6: true, KubeletUID: uidPtr(0)})
	pod, node := newNS(t), newNS(t)
	opts := PodOptions{DNSCapture: true}
	steps := []struct {
		name string
		do   func() error
	}{
		{"apply", func() error { return m.ApplyPod(ctx, pod, opts) }},
		{"verify", func() error { _, err := m.VerifyPod(ctx, pod, opts); return err }},
		{"apply again", func() error { return m.ApplyPod(ctx, pod, opts) }},
		{"delete", func() error { return m.DeletePod(ctx, pod) }},
		{"delete again", func() error { return m.DeletePod(ctx, pod) }},
		{"host", func() error {
			return node.Do(func(ns.NetNS) error {
				if err := m.EnsureHostRules(ctx); err != nil {
					return err
				}
				if _, err := m.RepairHostRules(ctx); err != nil {
					return err
				}
				if err := m.AddProbeIPs(ctx, "u", addrs("10.0.0.1")); err != nil {
					return err
				}
				return m.DeleteHostRules(ctx)
			})
		}},
	}
	for _, s := range steps {
		before := m.spawned.Load()
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if n := m.spawned.Load() - before; n != 0 {
			t.Errorf("%s spawned %d processes, want 0", s.name, n)
		}
	}
}
