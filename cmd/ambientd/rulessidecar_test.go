package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
)

// TestRulesSidecar: `ambientd rules --sidecar` prints, for an injected pod
// (a golden pod from Istio's injector, or annotations and proxy flags), the
// rules the agent programs for it — the builders' own rendering — and
// refuses what the agent would refuse (an invalid annotation, with Istio's
// error) with exit 2.
func TestRulesSidecar(t *testing.T) {
	c, err := istiogolden.LoadCase("tproxy-dualstack")
	if err != nil {
		t.Fatal(err)
	}
	podFile := filepath.Join(t.TempDir(), "pod.yaml")
	data, err := os.ReadFile(filepath.Join(istiogolden.Dir(), "tproxy-dualstack.txtar"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, _ := strings.Cut(string(data), "-- injected.yaml --\n")
	injected, _, _ := strings.Cut(rest, "\n-- ")
	if err := os.WriteFile(podFile, []byte(injected), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := sidecar.Parse(c.Injected, c.IPs())
	if err != nil {
		t.Fatal(err)
	}
	rs := iptables.BuildSidecarRules(p.Options)
	tests := []struct {
		name    string
		args    []string
		code    int
		want    []string
		wantErr string
	}{
		{name: "golden pod, both families", args: []string{"--sidecar", "--pod", podFile, "--pod-ip", "10.244.0.17", "--pod-ip", "fd00:10:244::11"},
			want: []string{rs.RenderApply(iptables.IPv4), rs.RenderApply(iptables.IPv6), "fwmark 0x539 lookup 133", "ip -6 addr add ::6/128 dev lo"}},
		{name: "golden pod, nftables", args: []string{"--sidecar", "--nftables", "--pod", podFile, "--pod-ip", "10.244.0.17", "--pod-ip", "fd00:10:244::11"},
			want: []string{iptables.BuildSidecarRulesNFT(p.Options).Render()}},
		{name: "annotations", args: []string{"--sidecar", "--annotation", "traffic.sidecar.istio.io/excludeOutboundPorts=5432", "--proxy-env", "ISTIO_META_DNS_CAPTURE=true"},
			want: []string{"-A ISTIO_OUTPUT -p tcp -m tcp --dport 5432 -j RETURN", "-A ISTIO_OUTPUT_DNS -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053"}},
		{name: "custom uid", args: []string{"--sidecar", "--proxy-uid", "1000", "--family", "4"}, want: []string{"--uid-owner 1000 -j RETURN", "--gid-owner 1337 -j RETURN"}},
		{name: "not captured", args: []string{"--sidecar", "--annotation", "sidecar.istio.io/inject=false"}, want: []string{"# not a sidecar pod the agent captures: excluded due to inject-disabled annotation"}},
		{name: "invalid annotation", args: []string{"--sidecar", "--annotation", "traffic.sidecar.istio.io/includeInboundPorts=70000"}, code: 2,
			wantErr: `annotation value error for value includeInboundPorts; annotationFound = true: portList "70000" invalid`},
		{name: "delete refused", args: []string{"--sidecar", "--delete"}, code: 2, wantErr: "--delete"},
		{name: "missing pod file", args: []string{"--sidecar", "--pod", "/nonexistent.yaml"}, code: 2, wantErr: "--pod"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := runRules(tt.args, &out, &errb); code != tt.code {
				t.Fatalf("exit %d, want %d; stderr: %s", code, tt.code, errb.String())
			}
			for _, w := range tt.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
			if tt.wantErr != "" && !strings.Contains(errb.String(), tt.wantErr) {
				t.Errorf("stderr %q lacks %q", errb.String(), tt.wantErr)
			}
			if tt.code != 0 && out.Len() > 0 {
				t.Errorf("printed rules although it failed:\n%s", out.String())
			}
		})
	}
}
