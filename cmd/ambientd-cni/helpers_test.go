package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/cniserver"
	"github.com/ambientd/ambientd/test/infra/build"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// binDir holds the plugin under test and the reference plugins, built once by
// TestMain (exec'd tests need real binaries). It is world-readable so a test
// can run the plugin as a non-root user.
var binDir string

// waitTimeout bounds waits for the agent's state; the machine is shared.
const waitTimeout = 30 * time.Second

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "ambientd-cni-test-")
	if err == nil {
		err = os.Chmod(dir, 0o755)
	}
	if err == nil {
		err = buildBinaries(dir)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ambientd-cni tests: build binaries:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// buildBinaries builds ambientd-cni as `make build` does and the reference
// plugins at the version go.mod pins (test/infra/build: one home for both).
func buildBinaries(dir string) error {
	root, err := build.RepoRoot()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var log bytes.Buffer
	if err := build.BuildPrograms(ctx, &log, root, dir, "", "ambientd-cni"); err != nil {
		return fmt.Errorf("%w\n%s", err, log.String())
	}
	if err := build.BuildCNIPlugins(ctx, &log, root, dir); err != nil {
		return fmt.Errorf("%w\n%s", err, log.String())
	}
	return nil
}

// fakeAgent is a cniserver.Handler that records what the plugin told it.
type fakeAgent struct {
	mu      sync.Mutex
	adds    []agent.PodEvent
	dels    []agent.PodEvent
	outcome agent.Outcome
	addErr  error
	block   bool // never answer: wait for the caller to give up
}

func (a *fakeAgent) HandleAdd(ctx context.Context, ev agent.PodEvent) (agent.Outcome, error) {
	a.mu.Lock()
	a.adds = append(a.adds, ev)
	out, err, block := a.outcome, a.addErr, a.block
	a.mu.Unlock()
	if block {
		<-ctx.Done()
		return agent.OutcomeUnknown, ctx.Err()
	}
	return out, err
}

func (a *fakeAgent) HandleDel(ctx context.Context, ev agent.PodEvent) error {
	a.mu.Lock()
	a.dels = append(a.dels, ev)
	block := a.block
	a.mu.Unlock()
	if block {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

func (a *fakeAgent) events() (adds, dels []agent.PodEvent) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]agent.PodEvent(nil), a.adds...), append([]agent.PodEvent(nil), a.dels...)
}

// startAgent serves h on a fresh socket and returns its path; the server
// stops at cleanup.
func startAgent(t testing.TB, h cniserver.Handler) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cni.sock")
	serveAgent(t, h, sock)
	return sock
}

// serveAgent serves h on sock (replacing a stale socket there, as the agent
// does) until stop is called or the test ends; stop returns once the server
// has stopped and removed its socket.
func serveAgent(t testing.TB, h cniserver.Handler, sock string) (stop func()) {
	t.Helper()
	s := cniserver.New(cniserver.Config{SocketPath: sock}, h, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	testutil.Eventually(t, "agent serving", waitTimeout, s.Serving)
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("agent Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Error("agent did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// newNS creates a throwaway network namespace, removed at cleanup. Its lo is
// left down, as a container runtime hands a sandbox to the first plugin.
func newNS(t testing.TB) ns.NetNS {
	t.Helper()
	return testutil.NewNetNSWith(t, testutil.NetNSOptions{LoDown: true}).NS
}

// run is one exec of the plugin binary.
type run struct {
	stdout, stderr []byte
	exit           int
	took           time.Duration // wall clock, exec to exit
	cpu            time.Duration // user+system CPU of the plugin process
}

// cniError decodes stdout as a CNI error result.
func (r run) cniError(t testing.TB) *types.Error {
	t.Helper()
	var e types.Error
	if err := json.Unmarshal(r.stdout, &e); err != nil || e.Msg == "" {
		t.Fatalf("stdout is not a CNI error result (%v): %q\nstderr: %s", err, r.stdout, r.stderr)
	}
	return &e
}

// execPlugin runs ambientd-cni with the CNI environment and stdin given;
// attr, when set, applies to the process (e.g. to run it as another user).
func execPlugin(t testing.TB, env map[string]string, stdin []byte, attr *syscall.SysProcAttr) run {
	t.Helper()
	return execBinary(t, filepath.Join(binDir, "ambientd-cni"), env, stdin, attr)
}

func execBinary(t testing.TB, bin string, env map[string]string, stdin []byte, attr *syscall.SysProcAttr) run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{"CNI_PATH=" + binDir}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = attr
	start := time.Now()
	err := cmd.Run()
	r := run{stdout: stdout.Bytes(), stderr: stderr.Bytes(), took: time.Since(start)}
	if cmd.ProcessState != nil {
		r.cpu = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.exit = ee.ExitCode()
	default:
		t.Fatalf("exec %s: %v", bin, err)
	}
	if ctx.Err() != nil {
		t.Fatalf("%s did not exit within the test's bound", bin)
	}
	return r
}

// runtimeList loads the network a runtime would from confDir: its first
// file, a single-plugin .conf turned into a list as runtimes (containerd's
// go-cni, CRI-O's ocicni) do.
func runtimeList(t testing.TB, confDir string) *libcni.NetworkConfigList {
	t.Helper()
	files, err := libcni.ConfFiles(confDir, []string{".conf", ".conflist", ".json"})
	if err != nil || len(files) == 0 {
		t.Fatalf("conf dir: %v %v", files, err)
	}
	if filepath.Ext(files[0]) == ".conflist" {
		l, err := libcni.ConfListFromFile(files[0])
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	//lint:ignore SA1019 runtimes (containerd's go-cni, CRI-O's ocicni) still load single-plugin files this way
	c, err := libcni.ConfFromFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	//lint:ignore SA1019 runtimes (containerd's go-cni, CRI-O's ocicni) still load single-plugin files this way
	l, err := libcni.ConfListFromConf(c)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// forEachInstallMode runs test once per mode of the installer: its own
// conflist that sorts first (owned, the default), and our entry added to
// the node's config in place.
func forEachInstallMode(t *testing.T, test func(t *testing.T, inPlace bool)) {
	for _, inPlace := range []bool{false, true} {
		name := "owned"
		if inPlace {
			name = "in-place"
		}
		t.Run(name, func(t *testing.T) { test(t, inPlace) })
	}
}

// installOnNode makes a throwaway node's CNI dirs, writes the node's
// network config primary as confDir/file, and installs the plugin there
// with the installer, its entry pointing at the agent socket sock. The
// runtime finds our plugin only in hostBin.
func installOnNode(t *testing.T, file, primary, sock string, inPlace bool) (hostBin, confDir string, inst *cniinstall.Installer) {
	t.Helper()
	root := t.TempDir()
	hostBin, confDir = filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(confDir, file), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
	inst, err := cniinstall.New(cniinstall.Config{
		BinSource: filepath.Join(binDir, "ambientd-cni"), BinDir: hostBin, ConfDir: confDir, InPlace: inPlace,
		Entry: cniinstall.Entry{Type: "ambientd-cni", PluginSettings: cniapi.PluginSettings{AgentSocket: sock, Timeout: "30s", LogLevel: "debug", LogFile: filepath.Join(root, "plugin.log")}},
	}, testutil.Logger(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	if err := inst.Check(); err != nil {
		t.Fatal(err)
	}
	return hostBin, confDir, inst
}
