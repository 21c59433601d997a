package iptables

import (
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// probeSets lists both probe sets of n as "ip=comment"; a set that does not
// exist (IPv6 off) lists nothing.
func probeSets(t *testing.T, m *Manager, n ns.NetNS) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := n.Do(func(ns.NetNS) error {
		s, closeFn, err := m.be.Probes()
		if err != nil {
			return err
		}
		defer closeFn()
		for _, f := range []Family{IPv4, IPv6} {
			set, err := s.List(f)
			if err != nil && !rules.IsNoSet(err) {
				return err
			}
			for ip, c := range set {
				out[ip.String()] = c
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

func TestHostProbeRules(t *testing.T) {
	requireNFT(t)
	for _, mode := range allModes {
		t.Run(string(mode), func(t *testing.T) { testHostProbe(t, mode) })
	}
}

func uidPtr(u uint32) *uint32 { return &u }

// hostState is what the node's rules look like in the backend of mode:
// iptables-save of both families, or `nft -a list ruleset` (rule handles
// show any rewrite).
func hostState(t testing.TB, node ns.NetNS, mode Mode) string {
	t.Helper()
	if mode == ModeNFTables {
		return nftHandles(t, node)
	}
	return saveText(t, node, IPv4, mode) + "\n" + saveText(t, node, IPv6, mode)
}

// xtMode is the iptables variant to put foreign rules in for mode.
func xtMode(mode Mode) Mode {
	if mode == ModeNFTables {
		return ModeNFT
	}
	return mode
}

// probeNode joins a node and a pod netns (the node is the pod's gateway),
// with the pod's rules applied and an app plus ztunnel's inbound listener in
// the pod, and returns the node and a probe: a TCP connection from the node
// to the app, answered "<server>|-|<source the app saw>".
func probeNode(t *testing.T, m *Manager) (ns.NetNS, func() string) {
	t.Helper()
	node, pod := newNS(t), newNS(t)
	vethPair(t, pod, node, []netip.Addr{podIP}, []netip.Addr{peerIP})
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", appPort), "app", false)
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", InboundPort), "ztunnel-inbound", false)
	if err := m.ApplyPod(testCtx(t), pod, PodOptions{}); err != nil {
		t.Fatal(err)
	}
	return node, func() string {
		t.Helper()
		got, err := ask(node, "tcp", netip.AddrPortFrom(podIP, appPort), dialOpts{})
		if err != nil {
			t.Fatalf("probe from node: %v", err)
		}
		return normalizeOrigDst(got)
	}
}

func inNode(t *testing.T, node ns.NetNS, what string, fn func() error) {
	t.Helper()
	if err := node.Do(func(ns.NetNS) error { return fn() }); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func testHostProbe(t *testing.T, mode Mode) {
	ctx := testCtx(t)
	m := newTestManager(t, mode, Config{IPv6: true, KubeletUID: uidPtr(0)})
	node, probe := probeNode(t, m)
	for _, f := range []Family{IPv4, IPv6} {
		nsRun(t, node, tool(f, xtMode(mode), ""), "-w", "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-m", "comment", "--comment", "foreign", "-j", "ACCEPT")
	}
	nsRun(t, node, "nft", "add", "table", "inet", "foreign")

	// Before the pod's IP is in the set, the node's connection is captured
	// like any other inbound connection.
	inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
	if got, want := probe(), "ztunnel-inbound|-|"+peerIP.String(); got != want {
		t.Fatalf("probe without set entry: got %q, want %q", got, want)
	}
	if mode == ModeNFTables {
		golden, err := os.ReadFile(filepath.Join("testdata", "nft_host_v6.golden"))
		if err != nil {
			t.Fatal(err)
		}
		if got := nftList(t, node, NFTTableNat); got != string(golden) {
			t.Fatalf("nft list of the host rules differs from nft_host_v6.golden:\n%s", got)
		}
	}

	// In the set: SNATed to the probe address, which the pod lets through.
	inNode(t, node, "AddProbeIPs", func() error {
		return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String(), "fd00::2"))
	})
	if got, want := probe(), "app|-|"+ProbeSNATv4.String(); got != want {
		t.Fatalf("probe with set entry: got %q, want %q", got, want)
	}

	// Ensure again and add again: same rules, same entries.
	if mode != ModeNFTables {
		for _, f := range []Family{IPv4, IPv6} {
			want := ours(BuildHostRules(m.Config()).RenderApply(f), BuildHostRules(m.Config()))
			if got := ours(saveText(t, node, f, mode), BuildHostRules(m.Config())); !reflect.DeepEqual(got, want) {
				t.Fatalf("%s host rules: got %q, want golden %q", f, got, want)
			}
		}
	}
	before := hostState(t, node, mode)
	inNode(t, node, "EnsureHostRules again", func() error { return m.EnsureHostRules(ctx) })
	inNode(t, node, "AddProbeIPs again", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String())) })
	if got := hostState(t, node, mode); got != before {
		t.Fatalf("second EnsureHostRules changed the rules:\n%s\nvs\n%s", before, got)
	}
	want := map[string]string{podIP.String(): "uid-a", "fd00::2": "uid-a"}
	if got := probeSets(t, m, node); !maps.Equal(got, want) {
		t.Fatalf("probe sets %v, want %v", got, want)
	}

	// Removal by another uid (the IP was reused) leaves the entry.
	inNode(t, node, "RemoveProbeIPs other uid", func() error { return m.RemoveProbeIPs(ctx, "uid-b", addrs(podIP.String())) })
	if got := probeSets(t, m, node); !maps.Equal(got, want) {
		t.Fatalf("removal by another uid changed the sets: %v", got)
	}
	inNode(t, node, "RemoveProbeIPs", func() error { return m.RemoveProbeIPs(ctx, "uid-a", addrs("fd00::2", "10.9.9.9")) })
	delete(want, "fd00::2")
	if got := probeSets(t, m, node); !maps.Equal(got, want) {
		t.Fatalf("after removal: %v, want %v", got, want)
	}

	// Prune by difference: stale gone, live kept, missing added, relabelled.
	inNode(t, node, "AddProbeIPs stale", func() error { return m.AddProbeIPs(ctx, "uid-gone", addrs("10.1.1.1", "fd00::9")) })
	var ch ProbeChanges
	inNode(t, node, "PruneProbeIPs", func() error {
		var err error
		ch, err = m.PruneProbeIPs(ctx, map[string][]netip.Addr{
			"uid-a": addrs(podIP.String()),
			"uid-c": addrs("10.1.1.3", "fd00::3"),
			"uid-d": addrs("10.1.1.1"), // reused IP of a gone pod
		})
		return err
	})
	if want := (ProbeChanges{Added: 2, Relabelled: 1, Removed: 1}); ch != want {
		t.Errorf("PruneProbeIPs changes %+v, want %+v", ch, want)
	}
	inNode(t, node, "PruneProbeIPs again", func() error {
		var err error
		ch, err = m.PruneProbeIPs(ctx, map[string][]netip.Addr{
			"uid-a": addrs(podIP.String()),
			"uid-c": addrs("10.1.1.3", "fd00::3"),
			"uid-d": addrs("10.1.1.1"),
		})
		return err
	})
	if ch.Total() != 0 {
		t.Errorf("second PruneProbeIPs changed %+v, want nothing", ch)
	}
	want = map[string]string{podIP.String(): "uid-a", "10.1.1.3": "uid-c", "fd00::3": "uid-c", "10.1.1.1": "uid-d"}
	if got := probeSets(t, m, node); !maps.Equal(got, want) {
		t.Fatalf("after prune: %v, want %v", got, want)
	}
	if got, want := probe(), "app|-|"+ProbeSNATv4.String(); got != want {
		t.Fatalf("probe after prune: got %q, want %q", got, want)
	}

	// Delete: ours gone, foreign rules stay; again is fine.
	for i := 0; i < 2; i++ {
		inNode(t, node, "DeleteHostRules", func() error { return m.DeleteHostRules(ctx) })
		for _, f := range []Family{IPv4, IPv6} {
			s := saveText(t, node, f, xtMode(mode))
			if strings.Contains(s, "ISTIO_") || !strings.Contains(s, "--comment foreign -j ACCEPT") {
				t.Fatalf("%s after DeleteHostRules:\n%s", f, s)
			}
		}
		if out := nsRun(t, node, "ipset", "list", "-n"); strings.Contains(out, "istio-inpod-probes") {
			t.Fatalf("ipsets left: %s", out)
		}
		if out := nsRun(t, node, "nft", "list", "tables"); strings.Contains(out, "istio") || !strings.Contains(out, "inet foreign") {
			t.Fatalf("nft tables after DeleteHostRules:\n%s", out)
		}
	}
}

// TestProbeSetsRobust: a dual-stack pod on an IPv4-only agent, a probe set
// destroyed behind the agent's back, and concurrent relabelling of a reused
// IP — each must leave the sets right, not block enrollment or removal.
func TestProbeSetsRobust(t *testing.T) {
	requireNFT(t)
	for _, mode := range []Mode{ModeNFT, ModeNFTables} {
		t.Run(string(mode), func(t *testing.T) { testProbeSetsRobust(t, mode) })
	}
}

func testProbeSetsRobust(t *testing.T, mode Mode) {
	ctx := testCtx(t)
	m := newTestManager(t, mode, Config{}) // IPv6 off
	node := newNS(t)
	inNode := func(what string, fn func() error) {
		t.Helper()
		if err := node.Do(func(ns.NetNS) error { return fn() }); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	inNode("EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })

	// Dual-stack pod, IPv6 off: the IPv4 address is added, the IPv6 one
	// skipped; removal with the IPv6 address first still removes the IPv4 one.
	inNode("AddProbeIPs dual-stack", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs("fd00::5", "10.0.0.5")) })
	if got, want := probeSets(t, m, node), map[string]string{"10.0.0.5": "uid-a"}; !maps.Equal(got, want) {
		t.Fatalf("after dual-stack add: %v, want %v", got, want)
	}
	inNode("RemoveProbeIPs dual-stack", func() error { return m.RemoveProbeIPs(ctx, "uid-a", addrs("fd00::5", "10.0.0.5")) })
	if got := probeSets(t, m, node); len(got) != 0 {
		t.Fatalf("after dual-stack removal: %v, want empty", got)
	}

	// Host rules and set removed behind our back (another agent's clean-up,
	// e.g. Istio's on uninstall; the set cannot go while a rule uses it):
	// removal has nothing to do, adding recreates the set and the rules.
	other := newTestManager(t, mode, Config{})
	inNode("another agent's DeleteHostRules", func() error { return other.DeleteHostRules(ctx) })
	inNode("RemoveProbeIPs without a set", func() error { return m.RemoveProbeIPs(ctx, "uid-a", addrs("10.0.0.5")) })
	inNode("AddProbeIPs without a set", func() error { return m.AddProbeIPs(ctx, "uid-b", addrs("10.0.0.6")) })
	if got, want := probeSets(t, m, node), map[string]string{"10.0.0.6": "uid-b"}; !maps.Equal(got, want) {
		t.Fatalf("after re-creating add: %v, want %v", got, want)
	}
	if d, err := verifyHostIn(t, node, m); err != nil || !d.Empty() {
		t.Fatalf("host rules not restored with the set: %v %s", err, d)
	}
	if s := hostState(t, node, mode); !strings.Contains(s, "ISTIO_POSTRT") && !strings.Contains(s, "snat ip to") {
		t.Fatalf("host rules not restored with the set:\n%s", s)
	}

	// A reused IP: the old pod's removal and the new pod's add race. Whatever
	// the order, the entry ends up the new pod's.
	for i := range 50 {
		old, cur := fmt.Sprintf("uid-old-%d", i), fmt.Sprintf("uid-new-%d", i)
		inNode("AddProbeIPs old", func() error { return m.AddProbeIPs(ctx, old, addrs("10.0.0.7")) })
		errc := make(chan error, 2)
		go func() { errc <- node.Do(func(ns.NetNS) error { return m.RemoveProbeIPs(ctx, old, addrs("10.0.0.7")) }) }()
		go func() { errc <- node.Do(func(ns.NetNS) error { return m.AddProbeIPs(ctx, cur, addrs("10.0.0.7")) }) }()
		for range 2 {
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
		}
		if got := probeSets(t, m, node)["10.0.0.7"]; got != cur {
			t.Fatalf("round %d: reused IP's entry %q, want %q", i, got, cur)
		}
	}
}

func verifyHostIn(t testing.TB, node ns.NetNS, m *Manager) (Drift, error) {
	var d Drift
	err := node.Do(func(ns.NetNS) error {
		var err error
		d, err = m.VerifyHostRules(testCtx(t))
		return err
	})
	return d, err
}

// TestDeletePodRemovesIPv6RulesWithIPv6Off: a dual-stack pod whose IPv6
// rules were put there by someone else (Istio's agent, or ambientd run with
// --ipv6) loses them on DeletePod even when this manager has IPv6 off, so
// its IPv6 connections are not left redirected to a ztunnel that no longer
// serves it. An IPv4-only pod costs no extra process.
func TestDeletePodRemovesIPv6RulesWithIPv6Off(t *testing.T) {
	testutil.RequireIptables(t)
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			ctx := testCtx(t)
			off := newTestManager(t, mode, Config{})

			v4only := newNS(t)
			if err := off.ApplyPod(ctx, v4only, PodOptions{}); err != nil {
				t.Fatal(err)
			}
			before := off.spawned.Load()
			if err := off.DeletePod(ctx, v4only); err != nil {
				t.Fatal(err)
			}
			if n := off.spawned.Load() - before; n != 1 {
				t.Errorf("DeletePod of an IPv4-only pod spawned %d processes, want 1", n)
			}

			dual := newNS(t)
			nsRun(t, dual, "ip", "-6", "addr", "add", "fd00::5/64", "dev", "lo")
			if err := newTestManager(t, mode, Config{IPv6: true}).ApplyPod(ctx, dual, PodOptions{}); err != nil {
				t.Fatal(err)
			}
			if s := saveText(t, dual, IPv6, mode); !strings.Contains(s, "ISTIO_OUTPUT") {
				t.Fatalf("setup: no IPv6 rules:\n%s", s)
			}
			if err := off.DeletePod(ctx, dual); err != nil {
				t.Fatal(err)
			}
			for _, f := range []Family{IPv4, IPv6} {
				if s := saveText(t, dual, f, mode); strings.Contains(s, "ISTIO_") {
					t.Errorf("%s rules left after DeletePod with IPv6 off:\n%s", f, s)
				}
			}
		})
	}
}
