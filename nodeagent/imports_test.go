// Package nodeagent_test holds the fitness tests of the node agent's
// architecture: who may import whom (DESIGN.md, "Rooms"), and facts that two
// rooms must agree on.
package nodeagent_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/test/infra/testutil"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

const module = "github.com/ambientd/ambientd"

// deps lists the packages pkg imports, directly or not (go list -deps).
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	testutil.RequireBinary(t, "go")
	out, err := exec.Command("go", "list", "-deps", module+"/"+pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

// TestImports: the plugin imports no client-go and nothing of the agent but
// the API it shares; iptables and ztunnelproto import no Kubernetes and
// nothing of ours; the agent core imports no gRPC.
func TestImports(t *testing.T) {
	tests := []struct {
		pkgs []string
		// forbidden reports why dep may not be imported, or "".
		forbidden func(pkg, dep string) string
	}{
		{
			pkgs: []string{"cmd/ambientd-cni", "cniplugin"},
			forbidden: func(pkg, dep string) string {
				switch {
				case strings.HasPrefix(dep, "k8s.io/client-go"):
					return "client-go"
				case strings.HasPrefix(dep, module+"/") && dep != module+"/"+pkg &&
					dep != module+"/cniplugin" && dep != module+"/cniapi":
					return "ours, other than the shared CNI API"
				}
				return ""
			},
		},
		{
			pkgs: []string{"iptables", "ztunnelproto"},
			forbidden: func(pkg, dep string) string {
				switch {
				case strings.HasPrefix(dep, "k8s.io/"), strings.HasPrefix(dep, "sigs.k8s.io/"):
					return "Kubernetes"
				case strings.HasPrefix(dep, module+"/") && dep != module+"/"+pkg:
					return "ours"
				}
				return ""
			},
		},
		{
			pkgs: []string{"nodeagent/agent", "nodeagent/registry", "nodeagent/podstatus", "nodeagent/policy",
				"nodeagent/podnetns", "nodeagent/podmeta", "nodeagent/ztunnel"},
			forbidden: func(_, dep string) string {
				if strings.HasPrefix(dep, "google.golang.org/grpc") {
					return "gRPC (only nodeagent/cniserver speaks it)"
				}
				return ""
			},
		},
	}
	for _, tt := range tests {
		for _, pkg := range tt.pkgs {
			t.Run(pkg, func(t *testing.T) {
				for _, dep := range deps(t, pkg) {
					if why := tt.forbidden(pkg, dep); why != "" {
						t.Errorf("%s imports %s (%s)", pkg, dep, why)
					}
				}
			})
		}
	}
}

// TestZDSFactsAgree: iptables may not import ztunnelproto, so it repeats
// ztunnel's mark and ports in its rules; they must be ztunnelproto's.
func TestZDSFactsAgree(t *testing.T) {
	for _, c := range []struct {
		name       string
		rules, zds int
	}{
		{"proxy mark", iptables.ProxyMark, zp.ProxyMark},
		{"outbound port", iptables.OutboundPort, zp.OutboundPort},
		{"inbound port", iptables.InboundPort, zp.InboundPort},
		{"HBONE port", iptables.HBONEPort, zp.HBONEPort},
		{"DNS port", iptables.DNSPort, zp.DNSPort},
	} {
		if c.rules != c.zds {
			t.Errorf("%s: iptables has %#x, ztunnelproto %#x", c.name, c.rules, c.zds)
		}
	}
}
