package sidecar_test

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	nft "github.com/google/nftables"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/policy"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
)

// cases loads the oracle's golden cases (Istio's own injector, plugin and
// builders, test/istio-oracle) or fails.
func cases(t *testing.T) []istiogolden.Case {
	t.Helper()
	cs, err := istiogolden.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) < 50 {
		t.Fatalf("only %d golden cases", len(cs))
	}
	return cs
}

// TestDecisionMatchesIstio: for every golden pod, the policy's data-plane
// decision is Istio's plugin outcome (captured, skipped, or an ADD error),
// with Istio's own reason for a skip and Istio's own error text for an
// invalid annotation.
func TestDecisionMatchesIstio(t *testing.T) {
	cfg := policy.DefaultConfig()
	for _, c := range cases(t) {
		t.Run(c.Name, func(t *testing.T) {
			if c.Injected == nil {
				t.Fatalf("no injected pod")
			}
			d := cfg.Decide(c.Injected, nil)
			if d.InMesh {
				t.Fatalf("decided ambient: %+v", d)
			}
			istioLog := c.Log
			if _, l, ok := strings.Cut(c.Log, ": "); ok {
				istioLog = l
			}
			switch {
			case c.Name == "skip-not-kubernetes":
				// No pod: the plugin passes a call without K8S_POD_NAME
				// through before asking the agent (cniplugin tests).
				return
			case c.Name == "skip-excluded-namespace":
				if d.Sidecar || d.Reason != policy.ReasonExcludedNamespace {
					t.Errorf("decision %+v, want excluded namespace (Istio: %s)", d, istioLog)
				}
				return
			case c.Name == "skip-host-network":
				// Istio's injector left it without istio-proxy; the runtime
				// never calls CNI for it; the policy rules it out first.
				if d.Sidecar || d.Reason != policy.ReasonHostNetwork {
					t.Errorf("decision %+v, want host network", d)
				}
				return
			case c.Outcome == "skipped" && policy.ProxyInfo(c.Injected).Found == false && c.Injected.Annotations["sidecar.istio.io/status"] == "":
				// A plain pod (Istio: "no istio-proxy"): not a sidecar pod
				// at all, so no sidecar reason is logged for it.
				if d.Sidecar || d.Reason != policy.ReasonNotLabelled {
					t.Errorf("decision %+v, want none", d)
				}
				return
			case c.Outcome == "skipped":
				if d.Sidecar || d.SidecarSkip != istioLog {
					t.Errorf("decision %+v\nwant skipped as Istio: %q", d, istioLog)
				}
				return
			}
			if !d.Sidecar {
				t.Fatalf("decision %+v, want sidecar capture (Istio: %s)", d, c.Outcome)
			}
			p, err := sidecar.Parse(c.Injected, c.IPs())
			if c.Outcome == "error" {
				if err == nil || !strings.HasSuffix(err.Error(), c.Error) {
					t.Fatalf("Parse error %v\nwant one ending with Istio's %q", err, c.Error)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			checkRedirect(t, p.Options, c.Redirect)
			if got, want := p.Options.IPv6, c.IPTables6 != ""; got != want {
				t.Errorf("IPv6 captured %v, Istio %v", got, want)
			}
			if strings.Contains(c.Log, "warn") != (len(p.Warnings) > 0) {
				t.Errorf("warnings %q, Istio logged %q", p.Warnings, c.Log)
			}
		})
	}
}

// checkRedirect compares the parsed options with Istio's parsed Redirect.
func checkRedirect(t *testing.T, o iptables.SidecarOptions, r map[string]string) {
	t.Helper()
	ports := func(all bool, ps []uint16) string {
		var s []string
		if all {
			s = append(s, "*")
		}
		for _, p := range ps {
			s = append(s, strconv.Itoa(int(p)))
		}
		return strings.Join(s, ",")
	}
	cidrs := func(all bool, cs []netip.Prefix) string {
		var s []string
		if all {
			s = append(s, "*")
		}
		for _, c := range cs {
			s = append(s, c.String())
		}
		return strings.Join(s, ",")
	}
	got := map[string]string{
		"redirectMode":             string(o.Mode),
		"noRedirectUID":            fmt.Sprint(o.ProxyUID),
		"noRedirectGID":            fmt.Sprint(o.ProxyGID),
		"includeIPCidrs":           cidrs(o.IncludeAllOutbound, o.IncludeOutboundCIDRs),
		"excludeIPCidrs":           cidrs(false, o.ExcludeOutboundCIDRs),
		"excludeInboundPorts":      ports(false, o.ExcludeInboundPorts),
		"includeInboundPorts":      ports(o.IncludeAllInbound, o.IncludeInboundPorts),
		"excludeOutboundPorts":     ports(false, o.ExcludeOutboundPorts),
		"includeOutboundPorts":     ports(false, o.IncludeOutboundPorts),
		"rerouteVirtualInterfaces": strings.Join(o.RerouteInterfaces, ","),
		"excludeInterfaces":        strings.Join(o.ExcludeInterfaces, ","),
		"dnsRedirect":              strconv.FormatBool(o.DNS),
		"invalidDrop":              strconv.FormatBool(o.InvalidDrop),
	}
	for k, v := range got {
		// Istio keeps the spaces the pod wrote ("8080, 9090"); the rule
		// tools read past them, and so do we.
		if want := strings.ReplaceAll(r[k], " ", ""); v != want {
			t.Errorf("%s = %q, Istio %q", k, v, want)
		}
	}
}

// TestRulesMatchIstio is the equality table: for every golden pod Istio
// programs, the rules we build for it equal what Istio's own builders
// produce, chain by chain, in the order the kernel holds them (Istio's
// restore input mixes -A and -I, so the text order is not the kernel's):
// the iptables rules per family in iptables-save form, and the native
// nftables tables (chains, base-chain hooks and priorities, rules) as `nft
// list` prints them. TestSidecarMatchesIstioInKernel (package iptables,
// root) loads both sides into real namespaces and compares the kernel's
// listings too.
func TestRulesMatchIstio(t *testing.T) {
	for _, c := range cases(t) {
		if !c.Programmed() {
			continue
		}
		t.Run(c.Name, func(t *testing.T) {
			p, err := sidecar.Parse(c.Injected, c.IPs())
			if err != nil {
				t.Fatal(err)
			}
			rs := iptables.BuildSidecarRules(p.Options)
			for _, fam := range []struct {
				f      iptables.Family
				golden string
			}{{iptables.IPv4, c.IPTables4}, {iptables.IPv6, c.IPTables6}} {
				ours := rs.Family(fam.f)
				if (ours != nil) != (fam.golden != "") {
					t.Errorf("%s: ours present %v, Istio's %v", fam.f, ours != nil, fam.golden != "")
					continue
				}
				if ours == nil {
					continue
				}
				want, err := istiogolden.ReplayIPTables(fam.golden, func(a string) string {
					return istiogolden.CanonicalIPTables(a, fam.f == iptables.IPv6)
				})
				if err != nil {
					t.Fatal(err)
				}
				compareChains(t, fam.f.String(), want, xtablesChains(ours))
			}

			want, err := istiogolden.ReplayNFT(c.NFT, istiogolden.CanonicalNFT)
			if err != nil {
				t.Fatal(err)
			}
			nft := iptables.BuildSidecarRulesNFT(p.Options)
			got := istiogolden.Chains{}
			gotChains := map[string][]string{}
			for _, tbl := range nft.Tables {
				got[tbl.Name] = map[string][]string{}
				for _, ch := range tbl.Chains {
					gotChains[tbl.Name] = append(gotChains[tbl.Name], ch.Name)
					got[tbl.Name][ch.Name] = nil
					if ch.Hook != nil {
						if spec, istio := nftSpec(ch), want.Spec[tbl.Name+" "+ch.Name]; spec != istio {
							t.Errorf("nft %s %s: %q, Istio %q", tbl.Name, ch.Name, spec, istio)
						}
					}
				}
				for _, r := range tbl.Rules {
					got[tbl.Name][r.Chain] = append(got[tbl.Name][r.Chain], r.Text())
				}
			}
			compareChains(t, "nft", want.Rules, got)
			for tbl, chains := range want.Chains {
				if !slices.Equal(chains, gotChains[tbl]) {
					t.Errorf("nft %s chains %v, Istio %v", tbl, gotChains[tbl], chains)
				}
			}
		})
	}
}

func xtablesChains(sf *iptables.SidecarFamily) istiogolden.Chains {
	out := istiogolden.Chains{}
	for t, chains := range sf.Chains {
		for _, c := range chains {
			if out[t] == nil {
				out[t] = map[string][]string{}
			}
			out[t][c] = sf.ChainRules(t, c)
		}
	}
	for _, r := range sf.Rules {
		if out[r.Table] == nil {
			out[r.Table] = map[string][]string{}
		}
		out[r.Table][r.Chain] = sf.ChainRules(r.Table, r.Chain)
	}
	return out
}

func nftSpec(c iptables.NFTChain) string {
	hooks := map[bool]string{true: "prerouting", false: "output"}
	return fmt.Sprintf("type %s hook %s priority %d", c.Type, hooks[*c.Hook == *nft.ChainHookPrerouting], c.Priority)
}

func compareChains(t *testing.T, what string, want, got istiogolden.Chains) {
	t.Helper()
	if w, g := want.Names(), got.Names(); !slices.Equal(w, g) {
		t.Errorf("%s: chains %v, Istio %v", what, g, w)
	}
	for table, chains := range want {
		for chain, rules := range chains {
			if g := got[table][chain]; !slices.Equal(rules, g) {
				t.Errorf("%s %s %s:\nours:\n  %s\nIstio:\n  %s", what, table, chain, strings.Join(g, "\n  "), strings.Join(rules, "\n  "))
			}
		}
	}
}
