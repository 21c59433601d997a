package build

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

const modulePath = "github.com/ambientd/ambientd"

// EnvRoot overrides where the repository is (default: the nearest parent of
// the working directory whose go.mod declares the ambientd module).
const EnvRoot = "AMBIENTD_ROOT"

// EnvKubeBinDir points at a directory holding etcd and the Kubernetes
// binaries, instead of the ones built into .cache/kube.
const EnvKubeBinDir = "AMBIENTD_KUBE_BIN_DIR"

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
