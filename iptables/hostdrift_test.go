package iptables

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// TestHostEarlierTerminalRule: a node whose nat POSTROUTING already holds a
// terminal rule for TCP (a firewall's ACCEPT) still SNATs probes: the
// iptables jump is inserted first, and nftables' own postrouting chain is
// not pre-empted by an accept in another nat chain.
func TestHostEarlierTerminalRule(t *testing.T) {
	requireNFT(t)
	for _, mode := range allModes {
		t.Run(string(mode), func(t *testing.T) {
			ctx := testCtx(t)
			m := newTestManager(t, mode, Config{KubeletUID: uidPtr(0)})
			node, probe := probeNode(t, m)
			nsRun(t, node, tool(IPv4, xtMode(mode), ""), "-w", "-t", "nat", "-A", "POSTROUTING", "-p", "tcp", "-j", "ACCEPT")
			if mode == ModeNFTables {
				nsRun(t, node, "nft", "add", "table", "inet", "firewall")
				nsRun(t, node, "nft", "add", "chain", "inet", "firewall", "post", "{ type nat hook postrouting priority 50; }")
				nsRun(t, node, "nft", "add", "rule", "inet", "firewall", "post", "meta", "l4proto", "tcp", "accept")
			}
			inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
			inNode(t, node, "AddProbeIPs", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String())) })
			if got, want := probe(), "app|-|"+ProbeSNATv4.String(); got != want {
				t.Fatalf("probe with an earlier terminal POSTROUTING rule: got %q, want %q", got, want)
			}
			if mode != ModeNFTables {
				if s := saveText(t, node, IPv4, mode); !strings.Contains(s, "-A POSTROUTING -j ISTIO_POSTRT\n-A POSTROUTING -p tcp -j ACCEPT") {
					t.Fatalf("jump not first:\n%s", s)
				}
			}
		})
	}
}

// TestHostRulesDriftRepair: a host rule deleted by hand (or a firewall
// reload that put its own rule first) is reported by VerifyHostRules and
// put back by RepairHostRules, which reports what it repaired; an intact
// node is not touched.
func TestHostRulesDriftRepair(t *testing.T) {
	requireNFT(t)
	type breakage struct {
		name  string
		do    func(t *testing.T, node ns.NetNS)
		wantD string // a line the drift must contain
	}
	xt := func(mode Mode) []breakage {
		ipt := tool(IPv4, mode, "")
		return []breakage{
			{"jump deleted", func(t *testing.T, n ns.NetNS) {
				nsRun(t, n, ipt, "-w", "-t", "nat", "-D", "POSTROUTING", "-j", xtables.ChainPostrouting)
			}, "missing: iptables -t nat -I POSTROUTING 1 -j ISTIO_POSTRT"},
			{"snat rule flushed", func(t *testing.T, n ns.NetNS) {
				nsRun(t, n, ipt, "-w", "-t", "nat", "-F", xtables.ChainPostrouting)
			}, "missing: iptables -t nat -A ISTIO_POSTRT -p tcp -m owner --socket-exists"},
			{"terminal rule put first", func(t *testing.T, n ns.NetNS) {
				nsRun(t, n, ipt, "-w", "-t", "nat", "-I", "POSTROUTING", "1", "-p", "tcp", "-j", "ACCEPT")
			}, "unexpected: iptables -t nat -A POSTROUTING -j ISTIO_POSTRT"},
		}
	}
	cases := map[Mode][]breakage{
		ModeLegacy: xt(ModeLegacy),
		ModeNFT:    xt(ModeNFT),
		ModeNFTables: {
			{"snat rules flushed", func(t *testing.T, n ns.NetNS) {
				nsRun(t, n, "nft", "flush", "chain", "inet", nftables.TableNat, nftables.BasePostrouting)
			}, "missing: nft inet istio-ambient-nat postrouting: meta l4proto tcp meta skuid 0 ip daddr @istio-inpod-probes-v4"},
			{"table deleted", func(t *testing.T, n ns.NetNS) {
				nsRun(t, n, "nft", "delete", "table", "inet", nftables.TableNat)
			}, "missing: nft add table inet istio-ambient-nat"},
		},
	}
	for _, mode := range allModes {
		for _, b := range cases[mode] {
			t.Run(string(mode)+"/"+b.name, func(t *testing.T) {
				ctx := testCtx(t)
				m := newTestManager(t, mode, Config{KubeletUID: uidPtr(0)})
				node, probe := probeNode(t, m)
				inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
				inNode(t, node, "AddProbeIPs", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String())) })
				intact := hostState(t, node, mode)
				repair := func() Drift {
					t.Helper()
					var d Drift
					inNode(t, node, "RepairHostRules", func() error {
						var err error
						d, err = m.RepairHostRules(ctx)
						return err
					})
					return d
				}
				if d := repair(); !d.Empty() {
					t.Fatalf("intact node: repaired %s", d)
				}
				if got := hostState(t, node, mode); got != intact {
					t.Fatalf("repair of an intact node changed it:\n%s\nvs\n%s", intact, got)
				}

				b.do(t, node)
				if got := probe(); got == "app|-|"+ProbeSNATv4.String() {
					t.Fatalf("breakage %q did not break probes", b.name)
				}
				d, err := verifyHostIn(t, node, m)
				if err != nil || !strings.Contains(d.String(), b.wantD) {
					t.Fatalf("VerifyHostRules: %v\n%s\nwant a line containing %q", err, d, b.wantD)
				}
				if got := repair(); got.String() != d.String() {
					t.Fatalf("RepairHostRules reported %s, want %s", got, d)
				}
				if d, err := verifyHostIn(t, node, m); err != nil || !d.Empty() {
					t.Fatalf("after repair: %v %s", err, d)
				}
				if b.name == "table deleted" {
					// The set went with the table: the agent's probe-set
					// prune re-adds live pods; here the pod is re-added.
					inNode(t, node, "AddProbeIPs", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String())) })
				}
				if got, want := probe(), "app|-|"+ProbeSNATv4.String(); got != want {
					t.Fatalf("probe after repair: got %q, want %q", got, want)
				}
			})
		}
	}
}

// TestAdoptIstioHostRules: a node Istio's agent set up (its exact rules,
// with a foreign rule after them) verifies clean and EnsureHostRules leaves
// it byte-identical: no duplicate, nothing reordered.
func TestAdoptIstioHostRules(t *testing.T) {
	requireNFT(t)
	for _, mode := range allModes {
		t.Run(string(mode), func(t *testing.T) {
			ctx := testCtx(t)
			m := newTestManager(t, mode, Config{IPv6: true, KubeletUID: uidPtr(0)})
			node := newNS(t)
			if mode == ModeNFTables {
				script := `table inet istio-ambient-nat {
	set istio-inpod-probes-v4 { type ipv4_addr; comment "UUID of the pods that are part of ambient mesh"; }
	set istio-inpod-probes-v6 { type ipv6_addr; comment "UUID of the pods that are part of ambient mesh"; }
	chain postrouting { type nat hook postrouting priority 100; }
}
add rule inet istio-ambient-nat postrouting meta l4proto tcp skuid 0 ip daddr @istio-inpod-probes-v4 counter snat ip to 169.254.7.127
add rule inet istio-ambient-nat postrouting meta l4proto tcp skuid 0 ip6 daddr @istio-inpod-probes-v6 counter snat ip6 to fd16:9254:7127:1337:ffff:ffff:ffff:ffff
add element inet istio-ambient-nat istio-inpod-probes-v4 { 10.77.0.2 comment "uid-istio" }
`
				path := filepath.Join(t.TempDir(), "istio.nft")
				if err := os.WriteFile(path, []byte(script), 0o644); err != nil {
					t.Fatal(err)
				}
				nsRun(t, node, "nft", "-f", path)
			} else {
				for _, f := range []Family{IPv4, IPv6} {
					fam := "inet"
					if f == IPv6 {
						fam = "inet6"
					}
					nsRun(t, node, "ipset", "create", f.ProbeSet(), "hash:ip", "family", fam, "comment")
					ipt := tool(f, mode, "")
					nsRun(t, node, ipt, "-w", "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-j", "ACCEPT")
					nsRun(t, node, ipt, "-w", "-t", "nat", "-N", xtables.ChainPostrouting)
					nsRun(t, node, ipt, "-w", "-t", "nat", "-I", "POSTROUTING", "1", "-j", xtables.ChainPostrouting)
					nsRun(t, node, ipt, "-w", "-t", "nat", "-A", xtables.ChainPostrouting, "-m", "owner", "--socket-exists", "-p", "tcp",
						"-m", "set", "--match-set", f.ProbeSet(), "dst", "-j", "SNAT", "--to-source", f.ProbeSNAT().String())
				}
				nsRun(t, node, "ipset", "add", ProbeSetV4, "10.77.0.2", "comment", "uid-istio")
			}
			before := hostState(t, node, mode)
			if d, err := verifyHostIn(t, node, m); err != nil || !d.Empty() {
				t.Fatalf("Istio's host rules do not verify clean: %v\n%s", err, d)
			}
			inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
			if after := hostState(t, node, mode); after != before {
				t.Fatalf("EnsureHostRules changed Istio's host rules:\n%s\nvs\n%s", before, after)
			}
			if got := probeSets(t, m, node); fmt.Sprint(got) != "map[10.77.0.2:uid-istio]" {
				t.Fatalf("Istio's probe set entries: %v", got)
			}
		})
	}
}
