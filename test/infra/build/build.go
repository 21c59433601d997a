// Package build is the one place that decides what each entry point needs —
// every make target that runs something (demo, e2e, e2e-node,
// bench-e2e, image, test) and the test programs behind them — and builds
// what is missing, once: the Debian packages (hack/deps.sh), etcd and the
// Kubernetes binaries from the Go module proxy (the wrapper module in
// hack/kube), the CNI reference plugins, our own binaries (bin/) and the
// agent image (hack/image.sh).
//
// The make targets call it through `go run ./hack/ensure TARGET`; the test
// programs call Ensure with the same Parts before they start anything, so a
// target run alone on a fresh clone and a program run with `go test` alone
// build the same things. A long first run prints one line per step with the
// elapsed time and what is left (see Progress); the build output goes to
// .cache/logs/, and a failure says where and what to do.
//
// Shipped code never imports this package.
package build

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// Part is one thing an entry point needs.
type Part string

const (
	// Packages are the Debian packages build, tests and the demo need
	// (hack/deps.sh): iptables, nftables, ipset, iproute2, protoc, …
	Packages Part = "packages"
	// NodePackages add containerd and runc for the real node (hack/deps.sh node).
	NodePackages Part = "node-packages"

	Etcd              Part = "etcd"
	KubeAPIServer     Part = "kube-apiserver"
	Kubelet           Part = "kubelet"
	ControllerManager Part = "kube-controller-manager"
	Scheduler         Part = "kube-scheduler"
	Kubectl           Part = "kubectl"
	// Helm is the helm command, built from the test-only module test/helm
	// at the version it pins for the chart's tests (make e2e-node installs
	// the chart with it).
	Helm Part = "helm"

	// CNIPlugins are the CNI reference plugins loopback, bridge and
	// host-local at the version go.mod pins (the pod network of every test
	// environment).
	CNIPlugins Part = "cni-plugins"
	// Ours are bin/ambientd, bin/ambientd-cni, bin/ztunnel-emulator,
	// bin/sidecar-validation, bin/multus (a test double) and
	// bin/dashboard-metrics (the dashboard's test, from test/helm).
	Ours Part = "ours"
	// Image is the agent image, bin/ambientd-image.tar (hack/image.sh).
	Image Part = "image"
)

// The sets the entry points need.
var (
	// ControlPlane: a real kube-apiserver + etcd and the CNI chain driven by
	// libcni, with our agent and the emulator (make e2e, bench-e2e, soak).
	ControlPlane = []Part{Packages, Etcd, KubeAPIServer, CNIPlugins, Ours}
	// Node: ControlPlane plus a real node (kubelet, containerd + runc,
	// controller-manager, scheduler, kubectl) running the agent's image
	// (make demo, e2e-node).
	Node = []Part{Packages, NodePackages, Etcd, KubeAPIServer, Kubelet, ControllerManager, Scheduler, Kubectl, CNIPlugins, Ours, Image}
)

// Targets maps every make target that runs something to what it needs. The
// Makefile calls `go run ./hack/ensure TARGET` first; TestMakefileEnsures
// keeps the two in step.
var Targets = map[string][]Part{
	"demo":       Node,
	"e2e-node":   append(slices.Clone(Node), Helm),
	"e2e":        ControlPlane,
	"bench-e2e":  ControlPlane,
	"soak":       ControlPlane,
	"soak-check": ControlPlane,
	"image":      {Packages, Image},
	"build":      {Ours},
	"test-root":  {Packages, CNIPlugins},
	// gofmt, vet, staticcheck and sloglint: Go alone.
	"verify":     {},
	"bench":      {Packages, CNIPlugins},
	"image-test": {Packages, NodePackages},
	// Istio's own node agent image (hack/istio-agent-image.sh): the Go
	// toolchain and the Debian layer's tools; Istio itself comes from the
	// module proxy through test/istio-oracle.
	"istio-agent-image": {Packages},
	// The switch scenarios run on the real node, with Istio's image too.
	"e2e-switch": Node,
	// Hollow nodes (make bench-cluster and its short version in check):
	// the control plane and N agents with their emulators.
	"bench-cluster":       ControlPlane,
	"bench-cluster-check": ControlPlane,
}

// kubeParts are built from the wrapper module hack/kube, in this order
// (kube-apiserver first: it fills the Go build cache the others share).
var kubeParts = []Part{Etcd, KubeAPIServer, Kubelet, ControllerManager, Scheduler, Kubectl}

// cold is how long each step took on a fresh 2-core machine with empty Go
// caches (the cold CI run): the estimate a first run prints.
var cold = map[Part]time.Duration{
	Packages:          40 * time.Second,
	NodePackages:      20 * time.Second,
	"modules":         90 * time.Second,
	Etcd:              60 * time.Second,
	KubeAPIServer:     510 * time.Second,
	Kubelet:           160 * time.Second,
	ControllerManager: 70 * time.Second,
	Scheduler:         20 * time.Second,
	Kubectl:           45 * time.Second,
	Helm:              200 * time.Second,
	CNIPlugins:        30 * time.Second,
	Ours:              90 * time.Second,
	Image:             60 * time.Second,
}

// What each part is called in progress lines.
var titles = map[Part]string{
	Packages:     "Debian packages",
	NodePackages: "Debian packages for the node (containerd, runc)",
	CNIPlugins:   "CNI reference plugins (loopback, bridge, host-local)",
	Ours:         "ambientd, ambientd-cni, ztunnel-emulator, sidecar-validation, multus, dashboard-metrics (bin/)",
	Image:        "the agent image (bin/ambientd-image.tar)",
	Helm:         "helm (the Helm command, from the module proxy: test/helm)",
	"modules":    "the Go modules of Kubernetes and etcd (download)",
}

// short names for the first line of a long run.
var short = map[Part]string{CNIPlugins: "the CNI reference plugins", Ours: "bin/", Image: "the image"}

func (p Part) short() string {
	if s, ok := short[p]; ok {
		return s
	}
	return string(p)
}

func (p Part) title() string {
	if t, ok := titles[p]; ok {
		return t
	}
	if rel := os.Getenv(EnvKubeRelease); rel != "" && slices.Contains(releaseParts, p) {
		return string(p) + " of Kubernetes " + rel
	}
	return string(p)
}

// cniRefPlugins are the reference plugins every test chain uses.
var cniRefPlugins = []string{
	"github.com/containernetworking/plugins/plugins/main/loopback",
	"github.com/containernetworking/plugins/plugins/main/bridge",
	"github.com/containernetworking/plugins/plugins/ipam/host-local",
}

// Program is one of our binaries and how `make build` builds it.
type Program struct {
	Name    string // the binary's name in bin/
	Package string // the main package
	// Tags are build tags. grpcnotrace keeps gRPC's x/net/trace (unused:
	// tracing is off) and with it html/template and text/template out:
	// ambientd-cni is exec'd per pod, and text/template's reflective method
	// calls make the linker keep every exported method of every type, 8 MB
	// of the agent (docs/scale.md, "Lean binary"; TestAgentBinaryLean).
	Tags []string
	// Shipped programs are in the image: stripped, without paths, and
	// stamped with the version.
	Shipped bool
	// Module is the directory, relative to the repository, of the
	// test-only module Package is in; empty: the product module.
	Module string
}

// Programs are bin/'s binaries (make build) — the one place their build
// flags are written; hack/image.sh builds the image's two from here too.
var Programs = []Program{
	{Name: "ambientd", Package: "./cmd/ambientd", Tags: []string{"grpcnotrace"}, Shipped: true},
	{Name: "ambientd-cni", Package: "./cmd/ambientd-cni", Tags: []string{"grpcnotrace"}, Shipped: true},
	{Name: "ztunnel-emulator", Package: "./test/ztunnel-emulator"},
	// Our istio-validation (sidecar mode's init container check), the
	// real-node suite's validation image and the e2e tests' check.
	{Name: "sidecar-validation", Package: "./test/sidecar-validation"},
	// The Multus plugin double (test/infra/multusemu): a node's meta-plugin
	// for the tests of the conf dir's other writers.
	{Name: "multus", Package: "./test/multus"},
	// The metric names of the chart's Grafana dashboard's queries, read
	// with Prometheus's PromQL parser (kept in test/helm's module, out of
	// the product's go.mod), for the dashboard's end-to-end test.
	{Name: "dashboard-metrics", Package: "./cmd/dashboard-metrics", Module: "test/helm"},
}

// buildArgs are the go build arguments for p into out.
func (p Program) buildArgs(out, version string) []string {
	args := []string{"build", "-buildvcs=false"}
	if len(p.Tags) > 0 {
		args = append(args, "-tags", strings.Join(p.Tags, ","))
	}
	if p.Shipped {
		ldflags := "-s -w"
		if version != "" {
			ldflags += " -X main.version=" + version
		}
		args = append(args, "-trimpath", "-ldflags="+ldflags)
	}
	return append(args, "-o", out, p.Package)
}

// Binaries are the paths of everything the environments run.
type Binaries struct {
	// Control plane: etcd and kube-apiserver. KubeDir holds etcd and
	// kubectl (hack/kube's) and, unless EnvKubeRelease names an older
	// release, kube-apiserver and the node's components too.
	KubeDir, Etcd, KubeAPIServer string
	// The real node: kubelet, kube-controller-manager, kube-scheduler and
	// kubectl (KubeDir), containerd, ctr, the runc shim and runc (Debian).
	Kubelet, ControllerManager, Scheduler, Kubectl string
	// Helm is the helm command (.cache/helm/VERSION/helm).
	Helm                        string
	Containerd, Ctr, Runc, Shim string
	// CNIRefDir holds the reference plugins loopback, bridge, host-local.
	CNIRefDir string
	// Ours, in bin/.
	Agent, CNIPlugin, Emulator, Validation string
	// Multus is the Multus plugin double (test/multus).
	Multus string
	// DashboardMetrics lists the dashboard's metric names (test/helm).
	DashboardMetrics string
	// Image is the agent image archive.
	Image string
}

// Locate returns where everything is or would be, without building or
// checking anything (Check does).
func Locate(root string) (Binaries, error) {
	kube, err := kubeDir(root)
	if err != nil {
		return Binaries{}, err
	}
	cni, err := cniRefDir(root)
	if err != nil {
		return Binaries{}, err
	}
	helm, err := helmPath(root)
	if err != nil {
		return Binaries{}, err
	}
	release := kube // the apiserver's and the node's release
	if rel := os.Getenv(EnvKubeRelease); rel != "" {
		if release, err = releaseDir(root, rel); err != nil {
			return Binaries{}, err
		}
	}
	if d := os.Getenv(EnvKubeBinDir); d != "" {
		kube, release = d, d
	}
	bin := filepath.Join(root, "bin")
	b := Binaries{
		KubeDir: kube, Etcd: filepath.Join(kube, "etcd"), KubeAPIServer: filepath.Join(release, "kube-apiserver"),
		Kubelet: filepath.Join(release, "kubelet"), ControllerManager: filepath.Join(release, "kube-controller-manager"),
		Scheduler: filepath.Join(release, "kube-scheduler"), Kubectl: filepath.Join(kube, "kubectl"),
		CNIRefDir: cni, Helm: helm,
		Agent: filepath.Join(bin, "ambientd"), CNIPlugin: filepath.Join(bin, "ambientd-cni"), Emulator: filepath.Join(bin, "ztunnel-emulator"),
		Validation: filepath.Join(bin, "sidecar-validation"), Multus: filepath.Join(bin, "multus"),
		DashboardMetrics: filepath.Join(bin, "dashboard-metrics"),
		Image:            filepath.Join(bin, "ambientd-image.tar"),
	}
	for _, x := range []struct {
		dst  *string
		name string
	}{{&b.Containerd, "containerd"}, {&b.Ctr, "ctr"}, {&b.Runc, "runc"}, {&b.Shim, "containerd-shim-runc-v2"}} {
		if p, err := exec.LookPath(x.name); err == nil {
			*x.dst = p
		}
	}
	return b, nil
}

// files are the files a part consists of ("" for a tool not on PATH).
func (b Binaries) files(p Part) []string {
	switch p {
	case Etcd:
		return []string{b.Etcd}
	case KubeAPIServer:
		return []string{b.KubeAPIServer}
	case Kubelet:
		return []string{b.Kubelet}
	case ControllerManager:
		return []string{b.ControllerManager}
	case Scheduler:
		return []string{b.Scheduler}
	case Kubectl:
		return []string{b.Kubectl}
	case Helm:
		return []string{b.Helm}
	case CNIPlugins:
		return []string{filepath.Join(b.CNIRefDir, "loopback"), filepath.Join(b.CNIRefDir, "bridge"), filepath.Join(b.CNIRefDir, "host-local")}
	case Ours:
		return []string{b.Agent, b.CNIPlugin, b.Emulator, b.Validation, b.Multus, b.DashboardMetrics}
	case Image:
		return []string{b.Image}
	case NodePackages:
		return []string{b.Containerd, b.Ctr, b.Runc, b.Shim}
	}
	return nil
}

// missing reports whether any file of p is absent.
func (b Binaries) missing(p Part) bool {
	for _, f := range b.files(p) {
		if isExecutable(f) != nil {
			return true
		}
	}
	return false
}

// Check reports the first part that is not in place, with what to run.
func (b Binaries) Check(parts ...Part) error {
	for _, p := range parts {
		for _, f := range b.files(p) {
			if f == "" {
				return fmt.Errorf("%s: not installed (run `make deps` as root, or `go run ./hack/ensure %s`)", p.title(), p)
			}
			if err := isExecutable(f); err != nil {
				return fmt.Errorf("%s: %w (run the make target again, or `go run ./hack/ensure %s`)", p.title(), err, p)
			}
		}
	}
	return nil
}

func isExecutable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		if os.IsNotExist(err) {
			return fmt.Errorf("%s is not built yet", p)
		}
		return err
	}
	if st.IsDir() || (st.Mode()&0o111 == 0 && !strings.HasSuffix(p, ".tar")) {
		return fmt.Errorf("%s is not an executable file", p)
	}
	return nil
}

// sortedParts returns parts in build order, each once.
func sortedParts(parts []Part) []Part {
	order := []Part{Packages, NodePackages, Etcd, KubeAPIServer, Kubelet, ControllerManager, Scheduler, Kubectl, Helm, CNIPlugins, Ours, Image}
	var out []Part
	for _, p := range order {
		if slices.Contains(parts, p) {
			out = append(out, p)
		}
	}
	return out
}
