package iptables

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
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

func TestPodOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		reroute string
		ok      bool
	}{
		{"", true},
		{"tap0", true},
		{"tap0,vm-eth1", true},
		{"tap0,", false},
		{",tap0", false},
		{"tap 0", false},
		{"waytoolonginterfacename", false},
		{"eth0!", false},
		{"..", false},
	} {
		err := PodOptions{RerouteInterfaces: tc.reroute}.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("Validate(RerouteInterfaces %q) = %v, want ok=%v", tc.reroute, err, tc.ok)
		}
	}
	// Invalid options never reach the rule tools.
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

// TestHostJumpFirst: the host jump is inserted at position 1; a jump found
// after someone else's rule is drift, and the repair moves it first.
func TestHostJumpFirst(t *testing.T) {
	rs := BuildHostRules(Config{})
	if b := rs.RenderApply(IPv4); !strings.Contains(b, "-I POSTROUTING 1 -j ISTIO_POSTRT\n") {
		t.Fatalf("apply batch does not insert the jump first:\n%s", b)
	}
	chain := "-A ISTIO_POSTRT " + strings.Join(rs.V4[0].Args, " ") + "\n"
	for _, tt := range []struct {
		name, post string
		drift      bool
	}{
		{"first", "-A POSTROUTING -j ISTIO_POSTRT\n-A POSTROUTING -j ACCEPT\n", false},
		{"only", "-A POSTROUTING -j ISTIO_POSTRT\n", false},
		{"after a terminal rule", "-A POSTROUTING -j ACCEPT\n-A POSTROUTING -j ISTIO_POSTRT\n", true},
		{"twice", "-A POSTROUTING -j ISTIO_POSTRT\n-A POSTROUTING -j ISTIO_POSTRT\n", true},
		{"missing", "-A POSTROUTING -j ACCEPT\n", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			st, err := parseSave("*nat\n:POSTROUTING ACCEPT [0:0]\n:ISTIO_POSTRT - [0:0]\n" + tt.post + chain + "COMMIT\n")
			if err != nil {
				t.Fatal(err)
			}
			d := rs.diff(IPv4, st)
			if d.Empty() == tt.drift {
				t.Fatalf("drift = %s, want drift %v", d, tt.drift)
			}
			repair := rs.renderRepair(IPv4, st)
			if !tt.drift {
				if repair != "" {
					t.Fatalf("repair of an intact node: %q", repair)
				}
				return
			}
			if !strings.HasSuffix(repair, "-I POSTROUTING 1 -j ISTIO_POSTRT\nCOMMIT\n") || strings.Contains(repair, "-D POSTROUTING -j ACCEPT") {
				t.Fatalf("repair batch:\n%s", repair)
			}
			if want := strings.Count(tt.post, "-j ISTIO_POSTRT"); strings.Count(repair, "-D POSTROUTING -j ISTIO_POSTRT") != want {
				t.Fatalf("repair must delete all %d existing jumps:\n%s", want, repair)
			}
		})
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

const savedPod = `# Generated by iptables-save v1.8.9 on Mon Nov 30 09:53:52 2026
*mangle
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
COMMIT
# Warning: iptables-legacy tables present, use iptables-legacy-save to see them
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
:FOREIGN - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A PREROUTING -p udp -j FOREIGN
-A OUTPUT -j ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A FOREIGN -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT -p udp -j DROP
-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
COMMIT
`

func TestDiffAndRepairFromSave(t *testing.T) {
	st, err := parseSave(savedPod)
	if err != nil {
		t.Fatal(err)
	}
	rs := BuildPodRules(Config{}, PodOptions{})
	d := rs.diff(IPv4, st)
	wantMissing := []string{
		"iptables -t nat -A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
		"iptables -t raw -N ISTIO_PRERT",
		"iptables -t raw -N ISTIO_OUTPUT",
		"iptables -t raw -A PREROUTING -j ISTIO_PRERT",
		"iptables -t raw -A OUTPUT -j ISTIO_OUTPUT",
	}
	wantUnexpected := []string{
		"iptables -t nat -A ISTIO_OUTPUT -p udp -j DROP",
		"iptables -t nat -A OUTPUT -j ISTIO_OUTPUT",
		"iptables -t nat -A FOREIGN -j ISTIO_OUTPUT",
	}
	if !reflect.DeepEqual(d.Missing, wantMissing) || !reflect.DeepEqual(d.Unexpected, wantUnexpected) {
		t.Errorf("diff:\n%s\nwant missing %q\nunexpected %q", d, wantMissing, wantUnexpected)
	}

	repair := rs.renderRepair(IPv4, st)
	for _, want := range []string{
		":ISTIO_OUTPUT - [0:0]",
		"-D OUTPUT -j ISTIO_OUTPUT\n",
		"-D FOREIGN -j ISTIO_OUTPUT\n",
		"*raw\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n-A PREROUTING -j ISTIO_PRERT\n-A OUTPUT -j ISTIO_OUTPUT\nCOMMIT\n",
	} {
		if !strings.Contains(repair, want) {
			t.Errorf("repair batch lacks %q:\n%s", want, repair)
		}
	}
	if n := strings.Count(repair, "-D OUTPUT -j ISTIO_OUTPUT"); n != 1 {
		t.Errorf("repair deletes the duplicate jump %d times, want 1:\n%s", n, repair)
	}
	if strings.Contains(repair, "-D PREROUTING") || strings.Contains(repair, "FOREIGN -") && !strings.Contains(repair, "-D FOREIGN -j ISTIO_OUTPUT") {
		t.Errorf("repair touches rules that are not ours:\n%s", repair)
	}

	del := rs.renderDeleteFrom(st)
	if strings.Contains(del, "*raw") {
		t.Errorf("delete touches raw where nothing of ours exists:\n%s", del)
	}
	for _, want := range []string{"-D PREROUTING -j ISTIO_PRERT\n", "-D FOREIGN -j ISTIO_OUTPUT\n", "-X ISTIO_PRERT\n", "-F ISTIO_OUTPUT\n"} {
		if !strings.Contains(del, want) {
			t.Errorf("delete batch lacks %q:\n%s", want, del)
		}
	}
	if n := strings.Count(del, "-D OUTPUT -j ISTIO_OUTPUT"); n != 3 || !strings.Contains(del, "*nat\n-D PREROUTING -j ISTIO_PRERT\n-D OUTPUT -j ISTIO_OUTPUT\n-D OUTPUT -j ISTIO_OUTPUT\n") {
		t.Errorf("delete removes %d OUTPUT jumps, want both nat ones and the mangle one:\n%s", n, del)
	}
	if strings.Contains(del, "-D PREROUTING -p udp -j FOREIGN") {
		t.Errorf("delete removes a foreign rule:\n%s", del)
	}

	empty, _ := parseSave("*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j ACCEPT\nCOMMIT\n")
	if b := rs.renderDeleteFrom(empty); b != "" {
		t.Errorf("delete from a clean state = %q, want nothing", b)
	}
}

func TestParseSaveRejectsGarbage(t *testing.T) {
	for _, in := range []string{"-A FOO -j ACCEPT\n", "*nat\nwhat is this\nCOMMIT\n"} {
		if _, err := parseSave(in); err == nil {
			t.Errorf("parseSave(%q) = nil error", in)
		}
	}
}
