package e2eenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

const modulePath = "github.com/ambientd/ambientd"

// EnvRoot overrides where the repository is (default: the nearest parent of
// the working directory whose go.mod declares the ambientd module).
const EnvRoot = "AMBIENTD_ROOT"

// EnvKubeBinDir points at a directory holding kube-apiserver and etcd, instead
// of the ones hack/build-kube.sh builds into .cache/kube.
const EnvKubeBinDir = "AMBIENTD_KUBE_BIN_DIR"

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

// Binaries are the programs the environment runs.
type Binaries struct {
	KubeAPIServer string
	Etcd          string
	// CNIRefDir holds the reference plugins loopback, bridge, host-local.
	CNIRefDir string
	// Ours, built by `make build` into bin/. They may be missing (or still be
	// placeholders): only the helpers that start them need them.
	Agent     string
	CNIPlugin string
	Emulator  string
}

// cniRefPlugins are the reference plugins the chain uses; portmap is left
// out because the chain does not need it and it would pull a dependency the
// main module does not have.
var cniRefPlugins = []string{
	"github.com/containernetworking/plugins/plugins/main/loopback",
	"github.com/containernetworking/plugins/plugins/main/bridge",
	"github.com/containernetworking/plugins/plugins/ipam/host-local",
}

// cniRefDir is where the reference plugins go, per plugins module version so a
// go.mod bump rebuilds them.
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

// EnsureBinaries builds what is missing: kube-apiserver and etcd through
// hack/build-kube.sh (about 10 minutes cold), the CNI reference plugins with
// go build. It does not build bin/ (that is `make build`). Build output goes
// to log. Needs the network only when the Go module cache lacks something, so
// call it before entering the node network namespace.
func EnsureBinaries(ctx context.Context, root string, log io.Writer) (Binaries, error) {
	b := ourBinaries(root)
	if d := os.Getenv(EnvKubeBinDir); d != "" {
		b.KubeAPIServer, b.Etcd = filepath.Join(d, "kube-apiserver"), filepath.Join(d, "etcd")
	} else {
		cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", "build-kube.sh"))
		cmd.Dir = root
		cmd.Stderr = log
		out, err := cmd.Output()
		if err != nil {
			return b, fmt.Errorf("hack/build-kube.sh: %w", exitDetail(err))
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		d := lines[len(lines)-1]
		b.KubeAPIServer, b.Etcd = filepath.Join(d, "kube-apiserver"), filepath.Join(d, "etcd")
	}
	dir, err := EnsureCNIRefPlugins(ctx, root, log)
	if err != nil {
		return b, err
	}
	b.CNIRefDir = dir
	return b, b.checkExternal()
}

// EnsureCNIRefPlugins builds the CNI reference plugins (loopback, bridge,
// host-local) into their cache dir when one is missing and returns the dir.
func EnsureCNIRefPlugins(ctx context.Context, root string, log io.Writer) (string, error) {
	dir, err := cniRefDir(root)
	if err != nil {
		return "", err
	}
	if missing(dir, "loopback", "bridge", "host-local") {
		fmt.Fprintf(log, "e2eenv: building CNI reference plugins into %s\n", dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
		args := append([]string{"build", "-o", dir + "/"}, cniRefPlugins...)
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		cmd.Stdout, cmd.Stderr = log, log
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("go build CNI reference plugins: %w", err)
		}
	}
	return dir, nil
}

// LocateBinaries finds the binaries EnsureBinaries built, without building
// anything (for use inside the node network namespace, which has no network).
func LocateBinaries(root string) (Binaries, error) {
	b := ourBinaries(root)
	if d := os.Getenv(EnvKubeBinDir); d != "" {
		b.KubeAPIServer, b.Etcd = filepath.Join(d, "kube-apiserver"), filepath.Join(d, "etcd")
	} else {
		d, err := kubeCacheDir(root)
		if err != nil {
			return b, err
		}
		b.KubeAPIServer, b.Etcd = filepath.Join(d, "kube-apiserver"), filepath.Join(d, "etcd")
	}
	dir, err := cniRefDir(root)
	if err != nil {
		return b, err
	}
	b.CNIRefDir = dir
	return b, b.checkExternal()
}

// kubeCacheDir mirrors hack/build-kube.sh's output directory naming.
func kubeCacheDir(root string) (string, error) {
	gomod := filepath.Join(root, "hack", "kube", "go.mod")
	kube, err := requiredVersion(gomod, "k8s.io/kubernetes")
	if err != nil {
		return "", err
	}
	etcd, err := requiredVersion(gomod, "go.etcd.io/etcd/server/v3")
	if err != nil {
		return "", err
	}
	return filepath.Join(root, ".cache", "kube", kube+"-etcd-"+etcd), nil
}

func ourBinaries(root string) Binaries {
	return Binaries{
		Agent:     filepath.Join(root, "bin", "ambientd"),
		CNIPlugin: filepath.Join(root, "bin", "ambientd-cni"),
		Emulator:  filepath.Join(root, "bin", "ztunnel-emulator"),
	}
}

func (b Binaries) checkExternal() error {
	for _, p := range []string{b.KubeAPIServer, b.Etcd, filepath.Join(b.CNIRefDir, "loopback"), filepath.Join(b.CNIRefDir, "bridge"), filepath.Join(b.CNIRefDir, "host-local")} {
		if err := isExecutable(p); err != nil {
			return fmt.Errorf("%w (run hack/build-kube.sh, or e2eenv.EnsureBinaries outside the node netns)", err)
		}
	}
	return nil
}

// requireBinary reports a clear error when one of bin/ is missing.
func requireBinary(path string) error {
	if err := isExecutable(path); err != nil {
		return fmt.Errorf("%w (run `make build`)", err)
	}
	return nil
}

func isExecutable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return fmt.Errorf("binary %s: %w", p, err)
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("binary %s is not executable", p)
	}
	return nil
}

func missing(dir string, names ...string) bool {
	for _, n := range names {
		if isExecutable(filepath.Join(dir, n)) != nil {
			return true
		}
	}
	return false
}

// exitDetail adds a failed command's stderr to its error.
func exitDetail(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, bytes.TrimSpace(ee.Stderr))
	}
	return err
}
