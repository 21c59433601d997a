package iptables

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{
		{Mode: "iptables"},
		{RerouteInterfaces: []string{"a b"}},
		{RerouteInterfaces: []string{""}},
		{RerouteInterfaces: []string{"waytoolonginterfacename"}},
		{RerouteInterfaces: []string{"eth0!"}},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil, want an error", c)
		}
	}
	if err := (Config{RerouteInterfaces: []string{"tap0", "vm-eth1"}, Mode: ModeNFT}).Validate(); err != nil {
		t.Errorf("valid config rejected: %v", err)
	}
}

// TestInvalidPodOptionsRefused: invalid options never reach the rule tools
// (the options' own validation is tested in package rules).
func TestInvalidPodOptionsRefused(t *testing.T) {
	m := &Manager{}
	bad := PodOptions{RerouteInterfaces: "a b"}
	if err := m.ApplyPod(t.Context(), nil, bad); err == nil || !strings.Contains(err.Error(), `"a b"`) {
		t.Errorf("ApplyPod with an invalid interface: %v, want an error naming it", err)
	}
	if _, err := m.VerifyPod(t.Context(), nil, bad); err == nil || !strings.Contains(err.Error(), `"a b"`) {
		t.Errorf("VerifyPod with an invalid interface: %v, want an error naming it", err)
	}
}

type goldenCase struct {
	name string
	fam  Family
	cfg  Config
	opts PodOptions
}

func goldenPodCases() []goldenCase {
	var out []goldenCase
	for _, fam := range []Family{IPv4, IPv6} {
		for _, dns := range []bool{false, true} {
			for _, bypass := range []bool{false, true} {
				out = append(out, goldenCase{
					name: fmt.Sprintf("pod_v%d_dns-%s_bypass-%s", fam, onOff(dns), onOff(bypass)),
					fam:  fam,
					cfg:  Config{IPv6: fam == IPv6},
					opts: PodOptions{DNSCapture: dns, BypassInbound: bypass},
				})
			}
		}
	}
	return append(out, goldenCase{
		name: "pod_v4_dns-on_bypass-off_reroute",
		fam:  IPv4,
		cfg:  Config{RerouteInterfaces: []string{"tap0", "tap1"}},
		opts: PodOptions{DNSCapture: true},
	}, goldenCase{
		// The pod's istio.io/reroute-virtual-interfaces: merged after the
		// node's, each interface once.
		name: "pod_v4_dns-on_bypass-off_pod-reroute",
		fam:  IPv4,
		cfg:  Config{RerouteInterfaces: []string{"tap0"}},
		opts: PodOptions{DNSCapture: true, RerouteInterfaces: "tap0,vm-eth1"},
	})
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

func checkGolden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run Golden -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the rendered batch (go test -run Golden -update rewrites it)\n--- got\n%s\n--- want\n%s", path, got, want)
	}
}

func TestGoldenPodRules(t *testing.T) {
	for _, c := range goldenPodCases() {
		t.Run(c.name, func(t *testing.T) {
			checkGolden(t, c.name, BuildPodRules(c.cfg, c.opts).RenderApply(c.fam))
		})
	}
	t.Run("pod_delete", func(t *testing.T) {
		checkGolden(t, "pod_delete", BuildPodRules(Config{}, PodOptions{}).RenderDelete(IPv4))
	})
	for _, fam := range []Family{IPv4, IPv6} {
		name := fmt.Sprintf("host_v%d", fam)
		t.Run(name, func(t *testing.T) {
			checkGolden(t, name, BuildHostRules(Config{IPv6: true}).RenderApply(fam))
		})
	}
}

// nftGoldenName is the nftables golden file of a case: one inet table set
// covers both families, so the _v6 cases are the ones with IPv6 on.
func nftGoldenName(c goldenCase) string { return "nft_" + strings.TrimPrefix(c.name, "pod_") }

func TestGoldenNFTRules(t *testing.T) {
	for _, c := range goldenPodCases() {
		t.Run(nftGoldenName(c), func(t *testing.T) {
			checkGolden(t, nftGoldenName(c), BuildPodRulesNFT(c.cfg, c.opts).Render())
		})
	}
	for _, ipv6 := range []bool{false, true} {
		name := "nft_host_v4"
		if ipv6 {
			name = "nft_host_v6"
		}
		t.Run(name, func(t *testing.T) {
			checkGolden(t, name, BuildHostRulesNFT(Config{IPv6: ipv6}, 0).Render())
		})
	}
}

// TestNFTRulesDiffer: each option changes the nftables rule set too, and
// with IPv6 off every rule is pinned to IPv4.
func TestNFTRulesDiffer(t *testing.T) {
	seen := map[string]string{}
	for _, c := range goldenPodCases() {
		got := BuildPodRulesNFT(c.cfg, c.opts).Render()
		if prev, ok := seen[got]; ok {
			t.Errorf("%s renders the same as %s", c.name, prev)
		}
		seen[got] = c.name
	}
	v4 := BuildPodRulesNFT(Config{}, PodOptions{DNSCapture: true})
	for _, tb := range v4.Tables {
		for _, r := range tb.Rules {
			if txt := r.Text(); !strings.HasPrefix(r.Chain, "istio-") {
				continue
			} else if !strings.Contains(txt, "ip ") && !strings.Contains(txt, "meta nfproto ipv4") {
				t.Errorf("IPv6 off, rule not pinned to IPv4: %s %s: %s", tb.Name, r.Chain, txt)
			}
		}
	}
	if s := v4.Render(); strings.Contains(s, "ip6 ") {
		t.Errorf("IPv6 rules without IPv6:\n%s", s)
	}
}

// TestRulesDiffer guards against golden files that all say the same thing:
// each option must change the rendered batch.
func TestRulesDiffer(t *testing.T) {
	seen := map[string]string{}
	for _, c := range goldenPodCases() {
		got := BuildPodRules(c.cfg, c.opts).RenderApply(c.fam)
		if prev, ok := seen[got]; ok {
			t.Errorf("%s renders the same as %s", c.name, prev)
		}
		seen[got] = c.name
	}
	v6 := BuildPodRules(Config{IPv6: true}, PodOptions{}).RenderApply(IPv6)
	if strings.Contains(v6, "127.0.0.1") || strings.Contains(v6, "169.254.7.127") || !strings.Contains(v6, "::1/128") {
		t.Errorf("IPv6 batch uses IPv4 addresses:\n%s", v6)
	}
	if rs := BuildPodRules(Config{}, PodOptions{}); rs.V6 != nil || len(rs.Families()) != 1 {
		t.Errorf("IPv6 rules without IPv6: %+v", rs.Families())
	}
}
