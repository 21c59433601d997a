package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/settings"
)

// runFlags are the agent's settings. Each package registers its own flags
// beside its Config's fields and validates them, naming the flag (node:
// daemon.Config with the agent's, node readiness's and sidecar mode's;
// rules: iptables.Config; install: installFlags); the fields here are the
// process's own. Every flag has an environment variable (settings.Var)
// that sets it when the command line does not.
type runFlags struct {
	kubeconfig, logLevel, handover string
	installCNI                     bool
	kubeQPS                        float64
	kubeBurst, gcPercent           int
	install                        installFlags
	node                           daemon.Config
	rules                          iptables.Config
}

// Kubernetes client rate limits: client-go's defaults (5 QPS, burst 10) are
// for controllers with a steady trickle; a node agent has bursts — a
// restart rebuilding every pod, a node full of pods created at once, each
// with a status patch and maybe a lookup GET.
const (
	defaultKubeQPS   = 20
	defaultKubeBurst = 50
)

// defaultGCPercent halves the collector's headroom (Go's default is 100):
// the agent's live heap is small (about 15 MiB at 1,000 pods) and it runs
// on every node, so the headroom is most of what it holds; the extra
// collections cost little CPU (docs/scale.md, "Memory").
const defaultGCPercent = 50

// parseRunFlags reads the agent's settings from args and the environment
// and validates them. Every bad value — one that fails to parse, on the
// command line or in a variable, and one a package's Validate refuses — is
// in the error, in a fixed order; the settings are filled as far as they
// could be read (the install lease is written from them even so).
func parseRunFlags(args []string, getenv func(string) string) (runFlags, error) {
	var f runFlags
	fs := f.flagSet()
	err := settings.Parse(fs, args, getenv, settings.Var)
	if settings.IsUsageError(err) || errors.Is(err, flag.ErrHelp) {
		return f, err
	}
	errs := []error{err}
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments: %q", fs.Args()))
	}
	f.share()
	errs = append(errs, f.validate()...)
	return f, errors.Join(errs...)
}

// flagSet registers every setting of `ambientd run` on a new flag set,
// bound to f's fields with their defaults.
func (f *runFlags) flagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("ambientd run", flag.ContinueOnError)
	fs.SetOutput(os.Stderr)
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; empty = in-cluster config")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.IntVar(&f.gcPercent, "gc-percent", defaultGCPercent, "the Go garbage collector's target (GOGC): the heap may grow this many percent over the live heap before a collection; lower costs CPU, saves memory on every node (0: leave the Go runtime's, i.e. GOGC or 100)")
	fs.Float64Var(&f.kubeQPS, "kube-qps", defaultKubeQPS, "Kubernetes API requests per second the agent may make (client-go rate limit)")
	fs.IntVar(&f.kubeBurst, "kube-burst", defaultKubeBurst, "Kubernetes API request burst above --kube-qps")
	fs.BoolVar(&f.installCNI, "install-cni", false, "install the CNI plugin into the host's bin dir and config, keep it there, report it in readiness (see docs/install.md)")
	fs.StringVar(&f.handover, "handover", string(iptables.SuccessorNone), "the node agent that takes the node over when this one uninstalls (not at an upgrade or restart): none (pods keep their rules as they are), istio (Istio's istio-cni with its chart defaults: iptables), istio-nftables (Istio's native nftables mode), or the backend an agent is pinned to (legacy, nft, nftables); before uninstalling, every enrolled pod's rules are moved to the backend that agent will use (docs/install.md, \"Switching\"). Needs --install-cni")
	f.node.RegisterFlags(fs)
	f.rules.RegisterFlags(fs)
	f.install.register(fs)
	return fs
}

// share copies the settings two parts use (one flag each) to the second.
func (f *runFlags) share() {
	a := &f.node.Agent
	f.node.CNIConfDir = f.install.confDir
	f.node.NodeReady.NodeName = a.NodeName
	f.rules.IPv6, f.rules.StateDir, f.rules.HostProc = a.IPv6, a.RunDir, a.HostProc
}

// validate checks the settings in a fixed order — the node's (daemon,
// agent, node readiness, sidecar mode), the rules', the installer's, then
// the process's own — and returns the first refusal of each part.
func (f runFlags) validate() []error {
	errs := []error{f.node.Validate(), f.rules.Validate()}
	if s, err := iptables.ParseSuccessor(f.handover); err != nil {
		errs = append(errs, fmt.Errorf("--handover: %w", err))
	} else if s != iptables.SuccessorNone && !f.installCNI {
		errs = append(errs, fmt.Errorf("--handover %s needs --install-cni: only the installer's shutdown rule tells an uninstall from an upgrade", f.handover))
	}
	if f.installCNI {
		_, err := f.install.config(f.node.CNISocket, f.node.Agent.Policy.ExcludeNamespaces)
		errs = append(errs, err)
	}
	if f.gcPercent < 0 {
		errs = append(errs, fmt.Errorf("--gc-percent %d: want 0 (the Go runtime's) or more", f.gcPercent))
	}
	if f.kubeQPS <= 0 || f.kubeBurst < 1 {
		errs = append(errs, fmt.Errorf("--kube-qps %v / --kube-burst %d: must be positive", f.kubeQPS, f.kubeBurst))
	}
	if _, err := parseLevel(f.logLevel); err != nil {
		errs = append(errs, fmt.Errorf("--log-level: %w", err))
	}
	return errs
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	return l, err
}
