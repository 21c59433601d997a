package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/shutdownrule"
)

// runCmd runs the node agent until SIGINT/SIGTERM.
func runCmd(args []string) int {
	f, err := parseRunFlags(args, os.Getenv)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	level, _ := parseLevel(f.logLevel)
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if f.installCNI {
		// First, before anything can fail — a setting refused below
		// included, as long as the install settings themselves are
		// usable: an agent that crash-loops still renews the install
		// lease, so the plugin keeps failing closed (docs/install.md,
		// "An uninstall nobody finished").
		if lerr := writeStartLease(f, log); lerr != nil {
			log.Warn("cannot write the install lease", "error", lerr)
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ambientd run: %v\n", err)
		reportStartFailure(f, err, log)
		return 2
	}
	if f.gcPercent > 0 {
		debug.SetGCPercent(f.gcPercent)
	}
	if f.node.PprofAddr == "" {
		// Nobody can read a heap profile: stop sampling allocations. The
		// samples' stacks fill a 1.4 MiB hash table page by page, and the
		// agent runs on every node (docs/scale.md, "Memory").
		runtime.MemProfileRate = 0
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, f, log); err != nil {
		log.Error("ambientd run failed", "error", err)
		return 1
	}
	return 0
}

// reportStartFailure names the refused setting in a node Event, when the
// agent's node and client configuration are usable: a crash-looping agent
// says why where an operator looks first.
func reportStartFailure(f runFlags, why error, log *slog.Logger) {
	if f.node.Agent.NodeName == "" {
		return
	}
	restCfg, err := kubeConfig(f.kubeconfig)
	if err != nil {
		return
	}
	restCfg.UserAgent = "ambientd/" + version
	client, err := kube.NewForConfig(restCfg)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := kube.ReportStartFailure(ctx, client, f.node.Agent.NodeName, "ambientd", why.Error()); err != nil {
		log.Warn("cannot record the refused setting in a node Event", "error", err)
	}
}

// run wires the pieces; all behaviour lives in nodeagent/.
func run(ctx context.Context, f runFlags, log *slog.Logger) error {
	restCfg, err := kubeConfig(f.kubeconfig)
	if err != nil {
		return err
	}
	restCfg.UserAgent = "ambientd/" + version
	restCfg.QPS, restCfg.Burst = float32(f.kubeQPS), f.kubeBurst
	requests := kube.NewRequestMetrics()
	restCfg.Wrap(requests.Wrap)
	client, err := kube.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	// The backend choice is persisted in the run dir (tmpfs: it survives
	// restarts, not reboots — as the rules themselves).
	rules, err := iptables.NewManager(ctx, f.rules, log.With("component", "iptables"))
	if err != nil {
		return fmt.Errorf("--iptables %s: %w", f.rules.Mode, err)
	}
	if err := rules.EnsureHostRules(ctx); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	cfg := f.node
	cfg.Version = version
	cfg.RequestMetrics = requests
	// With --install-cni the installer's own check (our entry last in the
	// config the runtime uses) feeds /readyz and the node condition;
	// without it the daemon reads the conf dir itself.
	var ci *daemon.InstallCNI
	if f.installCNI {
		icfg, _ := f.leaseConfig() // validated
		if icfg.Credentials, err = f.pluginCredentials(restCfg); err != nil {
			return err
		}
		successor, _ := iptables.ParseSuccessor(f.handover) // validated
		ilog := log.With("component", "cni-install")
		inst, err := cniinstall.New(icfg, ilog)
		if err != nil {
			return err
		}
		ci = daemon.NewInstallCNI(inst, shutdownrule.New(client, f.install.namespace, f.install.daemonSet, f.node.Agent.NodeName), rules, successor, ilog)
		defer ci.Finish()
		cfg.Agent.HandOver = ci.HandOver
		cfg.Agent.Uninstalling = ci.UninstallingAlone
		cfg.PluginInstalled = ci.Check
		cfg.InstallLease = ci.LeaseErr
		cfg.Components = append(cfg.Components, ci.Component())
	}
	node, err := daemon.New(cfg, client, rules, log)
	if err != nil {
		return err
	}
	if ci != nil {
		ci.CountInstalls(node.Istio())
	}
	log.Info("ambientd starting", "version", version, "node", cfg.Agent.NodeName, "ztunnel_socket", cfg.ZtunnelSocket, "cni_socket", cfg.CNISocket, "iptables", rules.Mode())
	return node.Run(ctx)
}

func kubeConfig(path string) (*rest.Config, error) {
	if path == "" {
		c, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig is empty and in-cluster config failed: %w", err)
		}
		return c, nil
	}
	c, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", path, err)
	}
	return c, nil
}
