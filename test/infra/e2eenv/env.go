package e2eenv

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/build"

	corev1 "k8s.io/api/core/v1"
)

// EnvKeep, set to 1, keeps the work directory (logs, kubeconfigs, etcd data)
// after Close, for debugging.
const EnvKeep = "AMBIENTD_E2E_KEEP"

// WorkDirPrefix starts the name of every work dir (in os.TempDir()),
// followed by the run id (EnvRunID) and a random suffix.
const WorkDirPrefix = "ambientd-e2e-"

// Options configure Start. The zero value is a working environment.
type Options struct {
	// NodeName is the Node object created for this "node" (default "e2e-node").
	NodeName string
	// NodeTaints are set on the Node at creation (e.g. the agent's startup
	// taint cni.istio.io/not-ready).
	NodeTaints []corev1.Taint
	// SkipNode creates no Node object: a real kubelet registers the node
	// itself (test/infra/nodeenv).
	SkipNode bool
	// AmbientPlugin puts bin/ambientd-cni last in the chain, configured for
	// the environment's CNI socket. Chain.SetAmbientPlugin changes it later.
	AmbientPlugin bool
	// Subnet for host-local (default 10.88.0.0/24).
	Subnet netip.Prefix
	// Log receives progress messages (default os.Stderr).
	Log io.Writer
	// APIServerArgs are extra kube-apiserver flags, ServingIPs more
	// addresses its certificate is valid for (ControlPlaneConfig).
	APIServerArgs []string
	ServingIPs    []net.IP
}

// Env is a running environment: control plane, chain, node, and whatever
// agents/emulators/pods were started through it (Close stops them all).
type Env struct {
	Root     string
	Bins     Binaries
	Dir      string // work directory, removed by Close unless AMBIENTD_E2E_KEEP=1
	NodeName string
	CP       *ControlPlane
	// Chain is the node's chain: bridge, plus our plugin last when
	// Options.AmbientPlugin. CreatePod uses it unless PodSpec.Chain says
	// otherwise.
	Chain *Chain
	// PlainChain is the same network (bridge, subnet, leases) without our
	// plugin, for pods that must not involve the agent.
	PlainChain *Chain
	// Sockets the agent serves (the emulator connects to ZtunnelSocket, our
	// CNI plugin to CNISocket).
	ZtunnelSocket string
	CNISocket     string
	// AgentRunDir is the agent's --run-dir (its pod state file).
	AgentRunDir string
	// AdminSocket is the agent's admin socket (`ambientd status`).
	AdminSocket string
	// CNIPluginLog is where bin/ambientd-cni logs when in the chain.
	CNIPluginLog string

	log      io.Writer
	sp       *spawner
	netnsDir string
	cgroups  *cgroups // the pods' sandbox cgroups

	mu    sync.Mutex
	pods  map[*Pod]struct{}
	procs []*Process
}

// Start brings the environment up in the current network namespace (use
// Main or RunIsolated to get a fresh one): control plane, RBAC from
// deploy/rbac.yaml, the Node, the CNI chain. On error everything is torn down.
func Start(ctx context.Context, opts Options) (env *Env, err error) {
	if opts.NodeName == "" {
		opts.NodeName = "e2e-node"
	}
	if opts.Log == nil {
		opts.Log = os.Stderr
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	bins, err := build.Locate(root)
	if err == nil {
		// Ours may be missing: only the helpers that start them need them.
		err = bins.Check(build.Etcd, build.KubeAPIServer, build.CNIPlugins)
	}
	if err != nil {
		return nil, err
	}
	// The run id in the name lets hack/e2e.sh find this run's work dirs.
	dir, err := os.MkdirTemp("", WorkDirPrefix+strings.ReplaceAll(os.Getenv(EnvRunID), "/", "_")+"-")
	if err != nil {
		return nil, err
	}
	e := &Env{
		Root: root, Bins: bins, Dir: dir, NodeName: opts.NodeName,
		ZtunnelSocket: filepath.Join(dir, "run", "ztunnel", "ztunnel.sock"),
		CNISocket:     filepath.Join(dir, "run", "ambientd", "cni.sock"),
		AgentRunDir:   filepath.Join(dir, "run", "ambientd"),
		AdminSocket:   filepath.Join(dir, "run", "ambientd", "admin.sock"),
		CNIPluginLog:  filepath.Join(dir, "logs", "ambientd-cni.log"),
		log:           opts.Log, sp: newSpawner(), netnsDir: filepath.Join(dir, "netns"),
		pods: map[*Pod]struct{}{},
	}
	defer func() {
		if err != nil {
			if cerr := e.Close(); cerr != nil {
				err = errors.Join(err, cerr)
			}
		}
	}()
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return e, err
	}
	if e.cgroups, err = setupCgroups(dir); err != nil {
		return e, err
	}

	e.CP, err = startControlPlane(ctx, e.sp, ControlPlaneConfig{
		EtcdBin: bins.Etcd, APIServerBin: bins.KubeAPIServer, Dir: dir,
		ExtraAPIServerArgs: opts.APIServerArgs, ServingIPs: opts.ServingIPs,
	})
	if err != nil {
		return e, fmt.Errorf("start control plane: %w", err)
	}
	fmt.Fprintf(e.log, "e2eenv: control plane ready at %s in %s (work dir %s)\n", e.CP.URL, e.CP.StartupTime.Round(time.Millisecond), dir)

	if _, err := e.CreateNamespace(ctx, AgentNamespace, nil); err != nil {
		return e, err
	}
	if err := ApplyManifest(ctx, e.CP.Admin, filepath.Join(root, "deploy", "rbac.yaml"), AgentNamespace); err != nil {
		return e, fmt.Errorf("apply RBAC: %w", err)
	}
	if !opts.SkipNode {
		if _, err := CreateNode(ctx, e.CP.Admin, e.NodeName, opts.NodeTaints); err != nil {
			return e, err
		}
	}

	var ambient map[string]any
	if opts.AmbientPlugin {
		ambient = AmbientPluginConf(e.CNISocket, e.CNIPluginLog)
	}
	chainCfg := ChainConfig{
		BinDirs:       []string{bins.CNIRefDir, filepath.Dir(bins.CNIPlugin)},
		Dir:           filepath.Join(dir, "cni"),
		Subnet:        opts.Subnet,
		AmbientPlugin: ambient,
	}
	if e.Chain, err = NewChain(chainCfg); err != nil {
		return e, fmt.Errorf("CNI chain: %w", err)
	}
	chainCfg.AmbientPlugin, chainCfg.ConfFile = nil, "20-plain.conflist"
	if e.PlainChain, err = NewChain(chainCfg); err != nil {
		return e, fmt.Errorf("CNI chain: %w", err)
	}
	return e, nil
}

// AmbientPluginConf is our plugin's chain entry for this environment.
func (e *Env) AmbientPluginConf() map[string]any {
	return AmbientPluginConf(e.CNISocket, e.CNIPluginLog)
}

func (e *Env) logPath(name string) string {
	return filepath.Join(e.Dir, "logs", name+".log")
}

// LogPath is where StartProcess(name, ...) logs.
func (e *Env) LogPath(name string) string { return e.logPath(name) }

// StartProcess starts path with args (and extra environment env) as a
// process of the environment: output to LogPath(name), killed with the test
// program (Pdeathsig), stopped by Close in reverse start order before the
// control plane. For programs the environment has no helper for, such as the
// real node's containerd and kubelet.
func (e *Env) StartProcess(name, path string, env []string, args ...string) (*Process, error) {
	p := newProcess(e.sp, name, path, e.logPath(name), args...)
	p.Env = env
	if err := p.Start(); err != nil {
		return nil, err
	}
	e.trackProcess(p)
	return p, nil
}

func (e *Env) trackProcess(p *Process) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.procs = append(e.procs, p)
}

// Close deletes the pods still tracked (DEL through the chain), stops every
// process started through the environment (agents and emulators first, then
// the control plane), unmounts what is left under the work dir and removes
// it. Safe to call on a partly started Env.
func (e *Env) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var errs []error
	for _, p := range e.trackedPods() {
		if e.CP != nil && e.CP.Admin != nil && p.chain != nil {
			if err := e.DeletePod(ctx, p); err != nil {
				errs = append(errs, fmt.Errorf("close: %w", err))
			}
		} else {
			errs = append(errs, p.teardown(ctx))
			e.untrack(p)
		}
	}
	if e.cgroups != nil {
		errs = append(errs, e.cgroups.close())
	}
	e.mu.Lock()
	procs := e.procs
	e.procs = nil
	e.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		errs = append(errs, procs[i].Stop(10*time.Second))
	}
	if e.CP != nil {
		errs = append(errs, e.CP.Stop())
	}
	if e.sp != nil {
		e.sp.close()
	}
	if e.Dir != "" {
		errs = append(errs, UnmountUnder(e.Dir))
		if os.Getenv(EnvKeep) == "1" {
			fmt.Fprintf(e.log, "e2eenv: kept work dir %s (%s=1)\n", e.Dir, EnvKeep)
		} else if err := os.RemoveAll(e.Dir); err != nil {
			errs = append(errs, fmt.Errorf("remove work dir: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Main is a TestMain for end-to-end test packages: Program running the
// package's tests, with the environment handed to use first.
func Main(m *testing.M, opts Options, use func(*Env)) {
	os.Exit(Program(opts, func(_ context.Context, e *Env) int {
		use(e)
		return m.Run()
	}))
}

// Program runs run with a started environment and returns the exit code for
// os.Exit. Outside a node netns it builds what is missing (kube-apiserver and
// etcd, the CNI reference plugins) and re-runs the program inside a fresh node
// network namespace (see RunIsolated); that inner run starts the environment,
// calls run, and closes the environment even when run failed. A failing Close
// turns exit code 0 into 1. ctx ends on SIGINT/SIGTERM.
func Program(opts Options, run func(ctx context.Context, e *Env) int) int {
	log := opts.Log
	if log == nil {
		log = os.Stderr
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if !InNodeNetns() {
		if _, err := build.Ensure(ctx, build.ControlPlane, build.Options{Log: log, Name: "the command you ran", MustExist: build.CheckOnly()}); err != nil {
			fmt.Fprintf(log, "build: %v\n", err)
			return 1
		}
		if build.CheckOnly() {
			fmt.Fprintf(log, "build: everything is in place (%s=1: not starting)\n", build.EnvCheckOnly)
			return 0
		}
		stop() // the child gets the signals; RunIsolated forwards them
		code, err := RunIsolated(context.Background(), log)
		if err != nil {
			fmt.Fprintf(log, "e2eenv: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
		return code
	}
	env, err := Start(ctx, opts)
	if err != nil {
		fmt.Fprintf(log, "e2eenv: start environment: %v\n", err)
		return 1
	}
	code := run(ctx, env)
	if err := env.Close(); err != nil {
		fmt.Fprintf(log, "e2eenv: close environment: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}
