package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRulesCmd(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		code    int
		golden  string   // iptables/testdata file the output must contain
		want    []string // substrings of stdout
		wantErr string   // substring of stderr
	}{
		// IPv6 on by default, as the agent (iptables.DefaultIPv6).
		{name: "defaults", code: 0, golden: "pod_v6_dns-on_bypass-off", want: []string{"# iptables-restore --noflush", "# ip6tables-restore --noflush"}},
		{name: "ipv6 off", args: []string{"--ipv6=false"}, golden: "pod_v4_dns-on_bypass-off"},
		{name: "dns off", args: []string{"--dns-capture=false"}, golden: "pod_v4_dns-off_bypass-off"},
		{name: "dns and bypass", args: []string{"--dns-capture", "--annotation", "ambient.istio.io/bypass-inbound-capture=true"}, golden: "pod_v4_dns-on_bypass-on"},
		{name: "annotation overrides dns", args: []string{"--dns-capture", "--annotation=ambient.istio.io/dns-capture=false"}, golden: "pod_v4_dns-off_bypass-off"},
		{name: "v6 only", args: []string{"--family", "6", "--dns-capture"}, golden: "pod_v6_dns-on_bypass-off", want: []string{"ip -6 route add local ::/0 dev lo table 100"}},
		{name: "both families", args: []string{"--ipv6", "--dns-capture=false"}, golden: "pod_v6_dns-off_bypass-off", want: []string{"# iptables-restore --noflush", "# ip6tables-restore --noflush"}},
		{name: "reroute", args: []string{"--dns-capture", "--reroute-interface", "tap0", "--reroute-interface=tap1"}, golden: "pod_v4_dns-on_bypass-off_reroute"},
		{name: "host", args: []string{"--host", "--ipv6"}, golden: "host_v6", want: []string{"ipset create istio-inpod-probes-v4 hash:ip family inet comment"}},
		{name: "delete", args: []string{"--delete"}, golden: "pod_delete"},
		{name: "nftables", args: []string{"--nftables", "--ipv6", "--dns-capture"}, golden: "nft_v6_dns-on_bypass-off"},
		{name: "nftables reroute", args: []string{"--nftables", "--ipv6=false", "--reroute-interface", "tap0,tap1"}, golden: "nft_v4_dns-on_bypass-off_reroute"},
		{name: "nftables host", args: []string{"--nftables", "--host", "--ipv6"}, golden: "nft_host_v6", want: []string{"meta skuid"}},
		{name: "nftables delete", args: []string{"--nftables", "--delete"}, want: []string{"delete table inet istio-ambient-nat\ndelete table inet istio-ambient-mangle\ndelete table inet istio-ambient-raw\n"}},
		{name: "bad annotation", args: []string{"--annotation", "ambient.istio.io/dns-capture=yes"}, code: 2, wantErr: `ambient.istio.io/dns-capture has invalid value "yes"`},
		{name: "annotation without value", args: []string{"--annotation", "foo"}, code: 2, wantErr: "want key=value"},
		{name: "bad family", args: []string{"--family", "5"}, code: 2, wantErr: `--family "5"`},
		{name: "bad interface", args: []string{"--reroute-interface", "a b"}, code: 2, wantErr: `"a b"`},
		{name: "stray argument", args: []string{"now"}, code: 2, wantErr: `unexpected argument "now"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := runRules(tt.args, &out, &errb)
			if code != tt.code {
				t.Fatalf("exit %d, want %d; stderr: %s", code, tt.code, errb.String())
			}
			if tt.golden != "" {
				g, err := os.ReadFile(filepath.Join("..", "..", "iptables", "testdata", tt.golden+".golden"))
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(out.String(), string(g)) {
					t.Errorf("output lacks %s.golden:\n%s", tt.golden, out.String())
				}
			}
			for _, w := range tt.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
			if tt.wantErr != "" && !strings.Contains(errb.String(), tt.wantErr) {
				t.Errorf("stderr %q lacks %q", errb.String(), tt.wantErr)
			}
			if code != 0 && out.Len() > 0 {
				t.Errorf("printed rules although it failed:\n%s", out.String())
			}
		})
	}
}
