package iptables

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

func TestParseSuccessor(t *testing.T) {
	for in, want := range map[string]Successor{
		"": SuccessorNone, "none": SuccessorNone, "istio": SuccessorIstio, "istio-nftables": SuccessorIstioNFTables,
		"legacy": "legacy", "nft": "nft", "nftables": "nftables",
	} {
		if got, err := ParseSuccessor(in); err != nil || got != want {
			t.Errorf("ParseSuccessor(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"auto", "Istio", "istio-iptables", "cilium", " istio"} {
		if _, err := ParseSuccessor(in); err == nil || !strings.Contains(err.Error(), "want none, istio") {
			t.Errorf("ParseSuccessor(%q): %v, want an error naming the choices", in, err)
		}
	}
}

// istioProbe does to node what the detection of Istio's agent
// (tools/istio-iptables/pkg/dependencies) does with iptables-legacy of one
// family at every start: add and delete a no-op rule in nat INPUT. It leaves
// the legacy nat table behind, empty.
func istioProbe(t *testing.T, node ns.NetNS, f Family) {
	t.Helper()
	rule := []string{"-w", "-t", "nat", "-A", "INPUT", "-p", "255", "-j", "RETURN"}
	nsRun(t, node, tool(f, ModeLegacy, ""), rule...)
	rule[3] = "-D"
	nsRun(t, node, tool(f, ModeLegacy, ""), rule...)
}

func legacyTables(t *testing.T, node ns.NetNS, f Family) string {
	t.Helper()
	name := "/proc/self/net/ip_tables_names"
	if f == IPv6 {
		name = "/proc/self/net/ip6_tables_names"
	}
	return strings.TrimSpace(nsRun(t, node, "cat", name))
}

// TestSuccessorMode: the backend ambientd hands pods over in is the one
// Istio's agent would pick on that node: in iptables mode legacy exactly
// when a legacy table exists (its own start-up probe leaves one), else nft;
// when only one family has legacy tables, the other's empty nat table is
// created (as Istio's probe would) so both use legacy; in native nftables
// mode nftables unless an iptables-mode probe ipset exists.
func TestSuccessorMode(t *testing.T) {
	testutil.RequireIptables(t)
	requireNFT(t)
	type tc struct {
		name  string
		s     Successor
		ipv6  bool
		setup func(*testing.T, ns.NetNS)
		want  Mode
		// legacy: the legacy tables each family must have afterwards.
		legacy map[Family]string
	}
	probeBoth := func(t *testing.T, node ns.NetNS) { istioProbe(t, node, IPv4); istioProbe(t, node, IPv6) }
	tests := []tc{
		{name: "istio, clean node", s: SuccessorIstio, ipv6: true, setup: func(*testing.T, ns.NetNS) {}, want: ModeNFT,
			legacy: map[Family]string{IPv4: "", IPv6: ""}},
		{name: "istio, after Istio's own probe (its second start)", s: SuccessorIstio, ipv6: true, setup: probeBoth, want: ModeLegacy},
		{name: "istio, legacy IPv4 table only: IPv6's is created", s: SuccessorIstio, ipv6: true,
			setup: func(t *testing.T, node ns.NetNS) { istioProbe(t, node, IPv4) }, want: ModeLegacy,
			legacy: map[Family]string{IPv4: "nat", IPv6: "nat"}},
		{name: "istio, legacy IPv6 table only: IPv4's is created", s: SuccessorIstio, ipv6: true,
			setup: func(t *testing.T, node ns.NetNS) { istioProbe(t, node, IPv6) }, want: ModeLegacy,
			legacy: map[Family]string{IPv4: "nat", IPv6: "nat"}},
		{name: "istio, IPv6 off: only IPv4 counts", s: SuccessorIstio, ipv6: false,
			setup: func(t *testing.T, node ns.NetNS) { istioProbe(t, node, IPv6) }, want: ModeNFT,
			legacy: map[Family]string{IPv4: ""}},
		{name: "istio, others' nft rules (kube-proxy in nft mode)", s: SuccessorIstio, ipv6: true, setup: func(t *testing.T, node ns.NetNS) {
			nsRun(t, node, tool(IPv4, ModeNFT, ""), "-w", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "1000", "-j", "ACCEPT")
		}, want: ModeNFT},
		{name: "istio-nftables, clean node", s: SuccessorIstioNFTables, ipv6: true, setup: probeBoth, want: ModeNFTables},
		{name: "istio-nftables, an iptables-mode probe ipset left: Istio stays on iptables", s: SuccessorIstioNFTables, ipv6: true,
			setup: func(t *testing.T, node ns.NetNS) {
				probeBoth(t, node)
				nsRun(t, node, "ipset", "create", ProbeSetV6, "hash:ip", "family", "inet6", "comment")
			}, want: ModeLegacy},
		{name: "istio-nftables, IPv6 off: an IPv6 probe ipset does not count", s: SuccessorIstioNFTables, ipv6: false,
			setup: func(t *testing.T, node ns.NetNS) {
				nsRun(t, node, "ipset", "create", ProbeSetV6, "hash:ip", "family", "inet6", "comment")
			}, want: ModeNFTables},
		{name: "pinned legacy", s: "legacy", ipv6: true, setup: func(*testing.T, ns.NetNS) {}, want: ModeLegacy,
			legacy: map[Family]string{IPv4: "", IPv6: ""}},
		{name: "pinned nftables", s: "nftables", ipv6: true, setup: probeBoth, want: ModeNFTables},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := newNS(t)
			tt.setup(t, node)
			var got Mode
			inNode(t, node, "SuccessorMode", func() error {
				var err error
				got, err = SuccessorMode(testCtx(t), tt.s, tt.ipv6, slog.New(slog.DiscardHandler))
				return err
			})
			if got != tt.want {
				t.Errorf("SuccessorMode(%s) = %q, want %q", tt.s, got, tt.want)
			}
			for f, want := range tt.legacy {
				if got := legacyTables(t, node, f); got != want {
					t.Errorf("legacy %s tables afterwards: %q, want %q", f, got, want)
				}
			}
		})
	}
	t.Run("none", func(t *testing.T) {
		if _, err := SuccessorMode(testCtx(t), SuccessorNone, true, nil); err == nil {
			t.Error("SuccessorMode(none): no error")
		}
	})
}
