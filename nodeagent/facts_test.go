package nodeagent_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
	"github.com/ambientd/ambientd/test/infra/build"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// TestFactsAgree: a fact that is written in more than one place — where a
// copy must cross a boundary the import rules forbid, or lives in a file
// that is not Go, or is a name other code refers to — has one home, and
// every other place agrees with it. (docs/architecture.md lists the facts
// and their homes; the deploy/ manifests are checked in deploy/, the
// command's flags and env tables in cmd/ambientd.)
func TestFactsAgree(t *testing.T) {
	dockerfile, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var cniProgram string
	for _, p := range build.Programs {
		if p.Package == "./cmd/ambientd-cni" {
			cniProgram = p.Name
		}
	}
	var dockerOut string
	for _, l := range strings.Split(string(dockerfile), "\n") {
		if f := strings.Fields(l); slices.Contains(f, "./cmd/ambientd-cni") && slices.Contains(f, "-o") {
			dockerOut = filepath.Base(f[slices.Index(f, "-o")+1])
		}
	}
	entry := e2eenv.AmbientPluginConf("/s", "/l")
	for _, c := range []struct {
		fact, where string
		got, home   any
	}{
		// The plugin's type is its binary's name: the installer writes it
		// into the CNI config and copies the binary of that name.
		{"plugin type", "build.Programs (bin/ name of ./cmd/ambientd-cni)", cniProgram, cniapi.PluginType},
		{"plugin type", "Dockerfile (go build -o of ./cmd/ambientd-cni)", dockerOut, cniapi.PluginType},
		{"plugin type", "e2eenv.AmbientPluginConf", entry["type"], cniapi.PluginType},
		// The ADD timeout the plugin takes without a setting is the one
		// the installer writes by default.
		{"plugin ADD timeout", "e2eenv.AmbientPluginConf", entry["timeout"], cniapi.DefaultPluginTimeout.String()},
		// The agent's sockets live in its run dir (one hostPath mount).
		{"run dir", "dir of cniapi.DefaultSocketPath", filepath.Dir(cniapi.DefaultSocketPath), agent.DefaultConfig().RunDir},
		{"run dir", "dir of admin.DefaultSocketPath", filepath.Dir(admin.DefaultSocketPath), agent.DefaultConfig().RunDir},
		// A restart restores a pod annotated enabled/pending in the phase
		// of that name (restart.go compares them).
		{"phase names", "registry.Enabled", registry.Enabled.String(), podmeta.RedirectionEnabled},
		{"phase names", "registry.Pending", registry.Pending.String(), podmeta.RedirectionPending},
		// The mesh's own namespace is where deploy/ installs the agent.
		{"system namespace", "admission.DefaultAgentNamespace", admission.DefaultAgentNamespace, policy.DefaultConfig().SystemNamespace},
	} {
		if c.got != c.home {
			t.Errorf("%s: %s is %v, its home says %v", c.fact, c.where, c.got, c.home)
		}
	}
	// The plugin's timeout must cover the agent's wait for an unknown pod,
	// or a slow API makes every ADD time out in the plugin first.
	if lookup := agent.DefaultConfig().PodLookupTimeout; lookup+5*time.Second > cniapi.DefaultPluginTimeout {
		t.Errorf("plugin ADD timeout %v does not cover the agent's pod lookup %v plus a ztunnel ack", cniapi.DefaultPluginTimeout, lookup)
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
