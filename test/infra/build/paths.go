package build

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

const modulePath = "github.com/ambientd/ambientd"

// EnvRoot overrides where the repository is (default: the nearest parent of
// the working directory whose go.mod declares the ambientd module).
const EnvRoot = "AMBIENTD_ROOT"

// EnvKubeBinDir points at a directory holding etcd and the Kubernetes
// binaries, instead of the ones built into .cache/kube.
const EnvKubeBinDir = "AMBIENTD_KUBE_BIN_DIR"

// EnvKubeRelease selects an older Kubernetes release for the control plane
// and the node: the minor ("1.35") of a wrapper module hack/kube-<minor>,
// whose kube-apiserver, kubelet, kube-controller-manager and kube-scheduler
// then replace hack/kube's; etcd and kubectl stay hack/kube's. Empty: the
// current release (hack/kube). `make e2e-node`'s E2E_NODE_KUBE_VERSION sets
// it (docs/realnode.md).
const EnvKubeRelease = "AMBIENTD_KUBE_RELEASE"

// EnvCheckOnly, set to 1, makes the environments' programs (the e2e and
// real-node suites, the demos, the benchmark) only check that everything
// they need is already built, and exit: hack/fresh-check.sh runs each make
// target's ensure step in a fresh copy, then its program this way.
const EnvCheckOnly = "AMBIENTD_CHECK_ONLY"

// CheckOnly reports whether EnvCheckOnly is set.
func CheckOnly() bool { return os.Getenv(EnvCheckOnly) == "1" }

// RepoRoot finds the repository root.
func RepoRoot() (string, error) {
	if r := os.Getenv(EnvRoot); r != "" {
		return filepath.Abs(r)
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find repository root: %w", err)
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.HasPrefix(bytes.TrimSpace(b), []byte("module "+modulePath+"\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("find repository root: no go.mod of module %s above the working directory (set %s)", modulePath, EnvRoot)
		}
		dir = parent
	}
}

// kubeVersions reads the Kubernetes and etcd versions the wrapper module pins.
func kubeVersions(root string) (kube, etcd string, err error) {
	gomod := filepath.Join(root, "hack", "kube", "go.mod")
	if kube, err = requiredVersion(gomod, "k8s.io/kubernetes"); err != nil {
		return "", "", err
	}
	if etcd, err = requiredVersion(gomod, "go.etcd.io/etcd/server/v3"); err != nil {
		return "", "", err
	}
	return kube, etcd, nil
}

// kubeDir is where the Kubernetes binaries go: one directory per wrapper
// module state, so bumping a version there rebuilds.
func kubeDir(root string) (string, error) {
	kube, etcd, err := kubeVersions(root)
	if err != nil {
		return "", err
	}
	return filepath.Join(root, ".cache", "kube", kube+"-etcd-"+etcd), nil
}

// releaseParts are the parts an older release (EnvKubeRelease) builds from
// its own wrapper module: the apiserver and the node's components, whose
// versions must agree (the version skew policy: no controller newer than
// the apiserver). etcd speaks the same v3 API to every release, and kubectl
// is only the tests' client.
var releaseParts = []Part{KubeAPIServer, Kubelet, ControllerManager, Scheduler}

// kubeModule is the wrapper module that builds p, and the Kubernetes
// version it pins: hack/kube-<minor> for releaseParts when EnvKubeRelease
// names an older release, else hack/kube.
func kubeModule(root string, p Part) (dir, version string, err error) {
	dir = filepath.Join(root, "hack", "kube")
	if rel := os.Getenv(EnvKubeRelease); rel != "" && slices.Contains(releaseParts, p) {
		if dir, err = releaseModule(root, rel); err != nil {
			return "", "", err
		}
	}
	version, err = requiredVersion(filepath.Join(dir, "go.mod"), "k8s.io/kubernetes")
	return dir, version, err
}

// releaseModule is the wrapper module of an older release's minor, or an
// error that lists the releases there are.
func releaseModule(root, minor string) (string, error) {
	dir := filepath.Join(root, "hack", "kube-"+minor)
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
		return dir, nil
	}
	found, _ := filepath.Glob(filepath.Join(root, "hack", "kube-*", "go.mod"))
	var have []string
	for _, f := range found {
		have = append(have, strings.TrimPrefix(filepath.Base(filepath.Dir(f)), "kube-"))
	}
	return "", fmt.Errorf("%s=%s: no wrapper module hack/kube-%s (older releases there are: %s; empty: the current one, hack/kube)",
		EnvKubeRelease, minor, minor, strings.Join(have, ", "))
}

// releaseDir is where an older release's binaries go: .cache/kube/<version>.
func releaseDir(root, minor string) (string, error) {
	dir, err := releaseModule(root, minor)
	if err != nil {
		return "", err
	}
	v, err := requiredVersion(filepath.Join(dir, "go.mod"), "k8s.io/kubernetes")
	if err != nil {
		return "", err
	}
	return filepath.Join(root, ".cache", "kube", v), nil
}

// helmPath is where the helm command goes, per Helm version test/helm pins.
func helmPath(root string) (string, error) {
	v, err := requiredVersion(filepath.Join(root, "test", "helm", "go.mod"), "helm.sh/helm/v4")
	if err != nil {
		return "", err
	}
	return filepath.Join(root, ".cache", "helm", v, "helm"), nil
}

// cniRefDir is where the reference plugins go, per plugins module version.
func cniRefDir(root string) (string, error) {
	v, err := requiredVersion(filepath.Join(root, "go.mod"), "github.com/containernetworking/plugins")
	if err != nil {
		return "", err
	}
	return filepath.Join(root, ".cache", "cni", v), nil
}

// requiredVersion reads the version a go.mod requires of module, without the
// go command (which could want the network).
func requiredVersion(gomod, module string) (string, error) {
	b, err := os.ReadFile(gomod)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", gomod, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "require "))
		if len(f) >= 2 && f[0] == module {
			return f[1], nil
		}
	}
	return "", fmt.Errorf("%s does not require %s", gomod, module)
}
