// Package nodeagent_test holds the fitness tests of the node agent's
// architecture: who may import whom (docs/architecture.md), and facts that two
// packages must agree on.
package nodeagent_test

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/test/infra/build"
)

const module = "github.com/ambientd/ambientd"

// deps lists the packages pkg imports, directly or not (go list -deps).
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", module+"/"+pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

// TestImports: the plugin imports no Kubernetes and nothing of the agent but
// the API it shares and the installer's file logic; ztunnelproto imports no Kubernetes and nothing of ours
// (iptables and its layers: TestRuleLayers); the agent core imports no gRPC.
func TestImports(t *testing.T) {
	tests := []struct {
		pkgs []string
		// forbidden reports why dep may not be imported, or "".
		forbidden func(pkg, dep string) string
	}{
		{
			// The plugin, exec'd for every pod, shares the CNI API, the
			// installer's file logic (to finish an uninstall nobody
			// finished) and the enrollment policy (to decide while no
			// agent answers), and reads the API through client-go's
			// kubeconfig loader and transport only: no typed clients and
			// no scheme of every API group, whose init would cost every
			// ADD. The installer imports no Kubernetes at all.
			pkgs: []string{"cmd/ambientd-cni", "cniplugin", "cniinstall"},
			forbidden: func(pkg, dep string) string {
				switch {
				case pkg == "cniinstall" && (strings.HasPrefix(dep, "k8s.io/") || strings.HasPrefix(dep, "sigs.k8s.io/")):
					return "Kubernetes"
				case slices.ContainsFunc(heavyClientGo, func(h string) bool { return strings.HasPrefix(dep, h) }):
					return "client-go's all-groups packages"
				case strings.HasPrefix(dep, "k8s.io/api/") && !slices.Contains(pluginAPIGroups, dep):
					return "an API group the plugin does not read"
				case strings.HasPrefix(dep, module+"/") && dep != module+"/"+pkg && !slices.Contains(pluginOurs, strings.TrimPrefix(dep, module+"/")):
					return "ours, other than the shared CNI API, installer file logic and policy"
				}
				return ""
			},
		},
		{
			// The istio-validation stand-in runs in a pod's init container
			// as the proxy's uid: the contract only, nothing of the agent.
			pkgs: []string{"test/sidecar-validation", "test/infra/validation"},
			forbidden: func(pkg, dep string) string {
				switch {
				case strings.HasPrefix(dep, "k8s.io/"), strings.HasPrefix(dep, "sigs.k8s.io/"):
					return "Kubernetes"
				case strings.HasPrefix(dep, module+"/") && dep != module+"/"+pkg && dep != module+"/test/infra/validation":
					return "ours"
				}
				return ""
			},
		},
		{
			// Sidecar mode's pod reading and lifecycle reach the rules
			// through package iptables and write nothing but Events; the
			// agent core reaches sidecar mode only through its hook.
			pkgs: []string{"nodeagent/sidecar", "nodeagent/repair"},
			forbidden: func(pkg, dep string) string {
				switch dep {
				case module + "/nodeagent/agent", module + "/nodeagent/registry", module + "/nodeagent/podstatus", module + "/nodeagent/ztunnel":
					return "the ambient lifecycle (sidecar mode is its own)"
				}
				return ""
			},
		},
		{
			pkgs: []string{"ztunnelproto"},
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
			pkgs: []string{"nodeagent/agent", "nodeagent/registry", "nodeagent/podstatus", "policy",
				"nodeagent/podnetns", "podmeta", "nodeagent/ztunnel", "nodeagent/sidecar", "nodeagent/repair"},
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

// pluginAPIGroups are the API groups the plugin links (it reads pods and
// namespaces, and a DaemonSet's metadata only), and pluginOurs our
// packages it may import.
var (
	pluginAPIGroups = []string{"k8s.io/api/core/v1"}
	pluginOurs      = []string{"cniplugin", "cniplugin/procinit", "cniplugin/kubeapi", "cniplugin/internal/ownedfile", "cniapi", "cniinstall", "policy", "podmeta"}
)

// agentAPIGroups are the Kubernetes API groups the agent binary may link:
// the ones nodeagent/kube's scheme registers.
// admissionregistration/v1: `ambientd check` reads whether deploy/'s
// admission policies are bound (the agent itself never does).
// node/v1: the RuntimeClass a pod names (a sandboxed runtime is never
// enrolled). admission/v1 (and authentication/v1, its UserInfo): the
// AdmissionReview `ambientd webhook` answers — types only, never
// registered in the client's scheme (about 0.7 MB of the binary with the
// webhook's server).
var agentAPIGroups = []string{"k8s.io/api/core/v1", "k8s.io/api/apps/v1", "k8s.io/api/admissionregistration/v1", "k8s.io/api/node/v1",
	"k8s.io/api/admission/v1", "k8s.io/api/authentication/v1"}

// heavyClientGo are the client-go packages that link (and, through
// kubernetes/scheme, register at init) every API group of Kubernetes, or
// the full clientset: ~33 MB of the agent binary until nodeagent/kube
// replaced them (docs/scale.md, "Lean binary"). The generic lister
// (k8s.io/client-go/listers itself) links no API group and is allowed.
var heavyClientGo = []string{
	"k8s.io/client-go/kubernetes",          // the Clientset, its typed clients, kubernetes/scheme, fake
	"k8s.io/client-go/informers",           // typed informers of every group
	"k8s.io/client-go/listers/",            // typed listers of every group
	"k8s.io/client-go/applyconfigurations", // apply configurations of every group
	"k8s.io/client-go/tools/events",        // events.k8s.io recorder (imports the Clientset)
	"k8s.io/client-go/dynamic",
	"k8s.io/client-go/discovery",
}

// TestAgentBinaryLean: the agent binary — every subcommand of
// cmd/ambientd is in it — built as `make build` builds it (the tags of
// build.Programs) links only the API groups it uses, none of client-go's
// all-groups packages, no text/template (its reflective method calls make
// the linker keep every exported method of every type: 8 MB) and no test
// infrastructure (test/infra/kubetest wraps the full clientset for tests),
// so its size and resident pages cannot creep back. The Dockerfile builds
// every shipped program with the same tags.
func TestAgentBinaryLean(t *testing.T) {
	var tags []string
	for _, p := range build.Programs {
		if p.Name == "ambientd" {
			tags = p.Tags
		}
	}
	out, err := exec.Command("go", "list", "-deps", "-tags", strings.Join(tags, ","), module+"/cmd/ambientd").Output()
	if err != nil {
		t.Fatalf("go list -deps cmd/ambientd: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		switch {
		case strings.HasPrefix(dep, "k8s.io/api/") && !slices.Contains(agentAPIGroups, dep):
			t.Errorf("cmd/ambientd links API group %s; allowed: %v (add a group to nodeagent/kube's scheme and here only if the agent uses it)", dep, agentAPIGroups)
		case slices.ContainsFunc(heavyClientGo, func(p string) bool { return dep == p || strings.HasPrefix(dep, strings.TrimSuffix(p, "/")+"/") }):
			t.Errorf("cmd/ambientd links %s, which links every API group: use nodeagent/kube", dep)
		case dep == "text/template":
			t.Errorf("cmd/ambientd (tags %v) links text/template: the linker then keeps every exported method (+8 MB); who imports it: go list -deps -f '{{.ImportPath}}: {{.Imports}}'", tags)
		case strings.HasPrefix(dep, module+"/test/"):
			t.Errorf("cmd/ambientd links test infrastructure %s", dep)
		}
	}

	dockerfile, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range build.Programs {
		if !p.Shipped {
			continue
		}
		var line string
		for _, l := range strings.Split(string(dockerfile), "\n") {
			if strings.Contains(l, "go build") && slices.Contains(strings.Fields(l), p.Package) {
				line = l
			}
		}
		want := "-tags " + strings.Join(p.Tags, ",")
		switch {
		case line == "":
			t.Errorf("Dockerfile: no go build line for %s", p.Package)
		case len(p.Tags) > 0 && !strings.Contains(line, want+" "):
			t.Errorf("Dockerfile builds %s without %q (build.Programs): %s", p.Package, want, strings.TrimSpace(line))
		case len(p.Tags) == 0 && strings.Contains(line, "-tags"):
			t.Errorf("Dockerfile builds %s with tags build.Programs has not: %s", p.Package, strings.TrimSpace(line))
		}
	}
}

// ruleLayers are the packages of the rule code (iptables/doc.go) and what
// each may import of ours besides itself. Outside iptables/ only the package
// iptables itself can be imported: the compiler enforces that (internal/).
var ruleLayers = map[string][]string{
	// top: the API package the agent uses; anything of the rule code.
	"iptables": {"iptables/"},
	// bottom: the shared vocabulary; nothing of ours.
	"iptables/internal/rules": nil,
	// middle: one package per technology; the bottom layer only, never a
	// sibling.
	"iptables/internal/xtables":  {"iptables/internal/rules"},
	"iptables/internal/nftables": {"iptables/internal/rules"},
	"iptables/internal/ipset":    {"iptables/internal/rules"},
}

// technologyLibs are the libraries of the rule technologies, which the
// bottom layer must not import.
var technologyLibs = []string{"github.com/google/nftables", "github.com/mdlayher/", "github.com/vishvananda/",
	"github.com/coreos/go-iptables", "github.com/containernetworking/"}

// TestRuleLayers pins the layers of the rule code: every package under
// iptables/ is on a layer (a new one must be added here); none imports
// Kubernetes or anything of ours outside iptables/; the technology packages
// import nothing of ours but the bottom layer (so never each other); and the
// bottom layer imports no netlink or iptables library.
func TestRuleLayers(t *testing.T) {
	out, err := exec.Command("go", "list", module+"/iptables/...").Output()
	if err != nil {
		t.Fatalf("go list %s/iptables/...: %v", module, err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if _, ok := ruleLayers[strings.TrimPrefix(pkg, module+"/")]; !ok {
			t.Errorf("%s is on no layer of the rule code: add it to ruleLayers (and to iptables/doc.go)", pkg)
		}
	}
	for pkg, allowed := range ruleLayers {
		t.Run(pkg, func(t *testing.T) {
			for _, dep := range deps(t, pkg) {
				ours := strings.TrimPrefix(dep, module+"/")
				switch {
				case strings.HasPrefix(dep, "k8s.io/"), strings.HasPrefix(dep, "sigs.k8s.io/"):
					t.Errorf("%s imports %s (Kubernetes)", pkg, dep)
				case ours == pkg:
				case ours == dep: // not ours
					if pkg == "iptables/internal/rules" && slices.ContainsFunc(technologyLibs, func(l string) bool { return strings.HasPrefix(dep, l) }) {
						t.Errorf("%s imports %s (the bottom layer owns no technology)", pkg, dep)
					}
				case !slices.ContainsFunc(allowed, func(a string) bool { return ours == a || strings.HasSuffix(a, "/") && strings.HasPrefix(ours, a) }):
					t.Errorf("%s imports %s (ours; this layer may import only %v)", pkg, dep, allowed)
				}
			}
		})
	}
}

// TestCmdIsWhatShips: cmd/ holds exactly the programs the image ships
// (build.Programs marked Shipped, each built by a Dockerfile line, checked
// in TestAgentBinaryLean); test stand-ins and build tools live under test/
// and hack/.
func TestCmdIsWhatShips(t *testing.T) {
	out, err := exec.Command("go", "list", module+"/cmd/...").Output()
	if err != nil {
		t.Fatalf("go list ./cmd/...: %v", err)
	}
	var cmd, shipped []string
	for _, pkg := range strings.Fields(string(out)) {
		cmd = append(cmd, "./"+strings.TrimPrefix(pkg, module+"/"))
	}
	for _, p := range build.Programs {
		if p.Shipped {
			shipped = append(shipped, p.Package)
		}
	}
	slices.Sort(cmd)
	slices.Sort(shipped)
	if !slices.Equal(cmd, shipped) {
		t.Errorf("go list ./cmd/... = %v, the shipped programs (build.Programs) = %v", cmd, shipped)
	}
}

// TestShippedCodeImportsNoTestInfra: no package outside test/ and hack/
// (what the shipped programs are built from, and every library of ours)
// imports anything under test/, directly or not — the test environments,
// fakes and oracles stay out of what runs on a node. The programs
// build.Programs marks as not shipped (the ztunnel emulator: a test
// stand-in) are test infrastructure themselves.
func TestShippedCodeImportsNoTestInfra(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{join .Deps " "}}`, module+"/...").Output()
	if err != nil {
		t.Fatalf("go list ./...: %v", err)
	}
	checked := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(f[0], module+"/")
		if strings.HasPrefix(pkg, "test/") || strings.HasPrefix(pkg, "hack/") || slices.ContainsFunc(build.Programs, func(p build.Program) bool {
			return !p.Shipped && p.Package == "./"+pkg
		}) {
			continue
		}
		checked++
		for _, dep := range f[1:] {
			if strings.HasPrefix(dep, module+"/test/") {
				t.Errorf("%s imports test infrastructure %s", pkg, dep)
			}
		}
	}
	if checked < 30 {
		t.Fatalf("only %d shipped packages listed: the test lists the wrong tree", checked)
	}
}
