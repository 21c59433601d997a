package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/cniinstall"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/kube"
)

// installFlags are the install-cni settings shared by `ambientd run`
// (with --install-cni) and `ambientd uninstall`.
type installFlags struct {
	binSource, binDir, confDir, confName, ownedName string
	owned                                           bool
	pluginLogLevel, pluginLogFile                   string
	pluginTimeout                                   time.Duration
	pollInterval, resync, repairWindow              time.Duration
	repairLimit                                     int
	daemonSet, namespace                            string
}

// installEnvOf maps the install flags to their environment variables.
var installEnvOf = flagEnv{
	"cni-bin-source":        "AMBIENTD_CNI_BIN_SOURCE",
	"cni-bin-dir":           "AMBIENTD_CNI_BIN_DIR",
	"cni-conf-dir":          "AMBIENTD_CNI_CONF_DIR",
	"cni-conf-name":         "AMBIENTD_CNI_CONF_NAME",
	"cni-owned-config":      "AMBIENTD_CNI_OWNED_CONFIG",
	"cni-owned-config-name": "AMBIENTD_CNI_OWNED_CONFIG_NAME",
	"cni-plugin-log-level":  "AMBIENTD_CNI_PLUGIN_LOG_LEVEL",
	"cni-plugin-log-file":   "AMBIENTD_CNI_PLUGIN_LOG_FILE",
	"cni-plugin-timeout":    "AMBIENTD_CNI_PLUGIN_TIMEOUT",
	"cni-poll-interval":     "AMBIENTD_CNI_POLL_INTERVAL",
	"cni-resync-interval":   "AMBIENTD_CNI_RESYNC_INTERVAL",
	"cni-repair-limit":      "AMBIENTD_CNI_REPAIR_LIMIT",
	"cni-repair-window":     "AMBIENTD_CNI_REPAIR_WINDOW",
	"daemonset-name":        "AMBIENTD_DAEMONSET_NAME",
	"daemonset-namespace":   "POD_NAMESPACE",
}

// register adds the install flags to fs (their variables: installEnvOf).
func (f *installFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.binSource, "cni-bin-source", "", "the plugin binary to install (default: ambientd-cni beside this executable)")
	fs.StringVar(&f.binDir, "cni-bin-dir", "/host/opt/cni/bin", "the host's CNI bin dir, as mounted")
	fs.StringVar(&f.confDir, "cni-conf-dir", "/host/etc/cni/net.d", "the host's CNI conf dir, as mounted")
	fs.StringVar(&f.confName, "cni-conf-name", "", "config file to insert into (default: the lexically first valid .conf/.conflist/.json, as runtimes choose)")
	fs.BoolVar(&f.owned, "cni-owned-config", true, "write our own conflist that sorts first (a copy of the primary config plus our plugin), so a primary CNI rewriting its own file cannot drop our plugin; false = insert our plugin into the primary's file (in-place mode)")
	fs.StringVar(&f.ownedName, "cni-owned-config-name", cniinstall.DefaultOwnedName, "file name of the owned conflist; must sort before the primary's")
	fs.DurationVar(&f.pollInterval, "cni-poll-interval", cniinstall.DefaultPollInterval, "how often the installer re-reads the CNI dirs while it cannot watch them with inotify (instances exhausted, watcher lost)")
	fs.DurationVar(&f.resync, "cni-resync-interval", cniinstall.DefaultResync, "period of the installer's full re-check, in case a file event was missed")
	fs.IntVar(&f.repairLimit, "cni-repair-limit", cniinstall.DefaultRepairLimit, "repairs of external rewrites within --cni-repair-window above which the installer warns of a fight and backs off")
	fs.DurationVar(&f.repairWindow, "cni-repair-window", cniinstall.DefaultRepairWindow, "sliding window of --cni-repair-limit")
	fs.StringVar(&f.pluginLogLevel, "cni-plugin-log-level", "info", "the plugin's logLevel in its config entry")
	fs.StringVar(&f.pluginLogFile, "cni-plugin-log-file", "", "the plugin's logFile on the host (default: stderr, i.e. the runtime's log)")
	fs.DurationVar(&f.pluginTimeout, "cni-plugin-timeout", cniapi.DefaultPluginTimeout, "the plugin's timeout for one ADD's call to the agent")
	fs.StringVar(&f.daemonSet, "daemonset-name", "ambientd", "the agent's DaemonSet, read at shutdown to tell uninstall from upgrade")
	fs.StringVar(&f.namespace, "daemonset-namespace", "istio-system", "the DaemonSet's namespace")
}

// config builds the installer's config; cniSocket is the agent's socket
// (the same path on the host: it is a hostPath mount) and exclude the
// namespaces the plugin passes through without asking the agent.
func (f installFlags) config(cniSocket string, exclude []string) (cniinstall.Config, error) {
	src := f.binSource
	if src == "" {
		exe, err := os.Executable()
		if err != nil {
			return cniinstall.Config{}, fmt.Errorf("--cni-bin-source: locating this executable: %w", err)
		}
		src = filepath.Join(filepath.Dir(exe), cniapi.PluginType)
	}
	if f.pluginTimeout <= 0 {
		return cniinstall.Config{}, fmt.Errorf("--cni-plugin-timeout %v: must be positive", f.pluginTimeout)
	}
	for name, d := range map[string]time.Duration{"--cni-poll-interval": f.pollInterval, "--cni-resync-interval": f.resync, "--cni-repair-window": f.repairWindow} {
		if d < 100*time.Millisecond {
			return cniinstall.Config{}, fmt.Errorf("%s %v: want at least 100ms", name, d)
		}
	}
	if f.repairLimit < 1 {
		return cniinstall.Config{}, fmt.Errorf("--cni-repair-limit %d: must be at least 1", f.repairLimit)
	}
	if _, err := parseLevel(f.pluginLogLevel); err != nil {
		return cniinstall.Config{}, fmt.Errorf("--cni-plugin-log-level: %w", err)
	}
	if f.pluginLogFile != "" && !filepath.IsAbs(f.pluginLogFile) {
		return cniinstall.Config{}, fmt.Errorf("--cni-plugin-log-file %q: must be an absolute path", f.pluginLogFile)
	}
	cfg := cniinstall.Config{
		BinSource: src, BinDir: f.binDir, ConfDir: f.confDir, ConfName: f.confName,
		InPlace: !f.owned, OwnedName: f.ownedName,
		PollInterval: f.pollInterval, Resync: f.resync, RepairLimit: f.repairLimit, RepairWindow: f.repairWindow,
		Entry: cniinstall.Entry{
			Type: cniapi.PluginType,
			PluginSettings: cniapi.PluginSettings{
				AgentSocket:       cniSocket,
				Timeout:           f.pluginTimeout.String(),
				ExcludeNamespaces: exclude,
				LogLevel:          f.pluginLogLevel,
				LogFile:           f.pluginLogFile,
			},
		},
	}
	return cfg, cfg.Validate()
}

// cniInstall is the installer as `ambientd run` uses it: its Run is a
// daemon component (Component), supervised like every other part.
type cniInstall struct {
	inst            *cniinstall.Installer
	shutdown        *cniinstall.ShutdownRule
	rules           *iptables.Manager
	log             *slog.Logger
	shutdownTimeout time.Duration
	// successor takes the node over at an uninstall (--handover).
	successor iptables.Successor

	// The shutdown rule is applied once, by the first of HandOver and
	// Finish to ask.
	decideOnce sync.Once
	uninstall  bool
	reason     string
	decideErr  error
	// handedOver: the pods' rules went to the successor.
	handedOver bool
}

// newCNIInstall builds the installer; nothing runs yet. Its Check belongs in
// the agent's readiness (and node condition); Finish, called once the daemon
// (the installer included) has stopped, applies the uninstall-on-shutdown
// rule.
func newCNIInstall(f installFlags, cfg cniinstall.Config, nodeName string, client kube.Interface, rules *iptables.Manager, successor iptables.Successor, log *slog.Logger) (*cniInstall, error) {
	inst, err := cniinstall.New(cfg, log)
	if err != nil {
		return nil, err
	}
	return &cniInstall{inst: inst, rules: rules, log: log, shutdownTimeout: 10 * time.Second, successor: successor,
		shutdown: cniinstall.NewShutdownRule(client, f.namespace, f.daemonSet, nodeName)}, nil
}

// decide applies the shutdown rule, once: the handover and the uninstall
// act on the same answer.
func (c *cniInstall) decide(ctx context.Context) (uninstall bool, reason string, err error) {
	c.decideOnce.Do(func() {
		c.uninstall, c.reason, c.decideErr = c.shutdown.Decide(ctx)
	})
	return c.uninstall, c.reason, c.decideErr
}

// HandOver is the agent's Config.HandOver: at an uninstall with a successor
// (--handover), it removes our host rules and probe sets — the successor's
// agent chooses its backend from the node as it finds it then — and returns
// a rule manager for the backend that agent will use, into which the agent
// moves every enrolled pod's rules. Otherwise (no successor, an upgrade or
// restart, no answer from the API) nil: the pods keep their rules.
func (c *cniInstall) HandOver(ctx context.Context) (agent.Successor, error) {
	if c.successor == iptables.SuccessorNone {
		return nil, nil
	}
	uninstall, reason, err := c.decide(ctx)
	if err != nil || !uninstall {
		return nil, nil // Finish logs the decision
	}
	log := c.log.With("successor", string(c.successor))
	log.Info("uninstalling with a handover: moving every enrolled pod's rules to the successor's backend", "reason", reason)
	if err := c.rules.DeleteHostRules(ctx); err != nil {
		return nil, fmt.Errorf("removing our host rules before the handover: %w", err)
	}
	mode, err := iptables.SuccessorMode(ctx, c.successor, c.rules.Config().IPv6, log)
	if err != nil {
		return nil, err
	}
	cfg := c.rules.Config()
	cfg.Mode, cfg.StateDir = mode, "" // the successor's choice is not ours to persist
	to, err := iptables.NewManager(ctx, cfg, log.With("component", "iptables-successor"))
	if err != nil {
		return nil, fmt.Errorf("the successor's backend %s: %w", mode, err)
	}
	log.Info("handing the pods over", "backend", string(mode), "from", string(c.rules.Mode()))
	c.handedOver = true
	return to, nil
}

// Component is the installer as a daemon component: started first, stopped
// last; it retries failures itself and never stops early.
func (c *cniInstall) Component() daemon.Component {
	return daemon.Func("CNI installer", func(ctx context.Context) error {
		// The shutdown rule needs one read of the DaemonSet with the
		// agent's identity first; it returns once it has it.
		go c.shutdown.Watch(ctx, c.log)
		return c.inst.Run(ctx)
	})
}

// Check is Ready as an error (nil = installed), the shape of
// nodeready.Inputs.PluginInstalled.
func (c *cniInstall) Check() error { return c.inst.Check() }

// Finish, once the installer has stopped (which leaves everything
// installed), uninstalls only when the DaemonSet is gone, being deleted or
// no longer selects this node, or the agent's identity was deleted
// (cniinstall.ShutdownRule); otherwise (upgrade, restart) everything stays.
func (c *cniInstall) Finish() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.shutdownTimeout)
	defer cancel()
	uninstall, reason, err := c.decide(ctx)
	if err != nil {
		c.log.Warn("cannot tell uninstall from upgrade; leaving the plugin and rules in place", "error", err)
		return nil
	}
	if !uninstall {
		c.log.Info("leaving the CNI plugin, its config and the rules in place", "reason", reason)
		return nil
	}
	c.log.Info("uninstalling from the node", "reason", reason)
	err = uninstallNode(ctx, c.inst, c.rules)
	if err == nil && c.handedOver {
		// Nothing of ours is left: no host rules, no pod rules.
		err = c.rules.ForgetChoice()
	}
	if err != nil {
		c.log.Error("uninstall failed", "error", err)
	}
	return err
}

// uninstallNode removes the plugin's config entry (or owned file), its
// binary, then the host probe rules and sets. In-pod rules stay: they go
// with their pods.
func uninstallNode(ctx context.Context, inst *cniinstall.Installer, rules *iptables.Manager) error {
	if err := inst.Uninstall(); err != nil {
		return fmt.Errorf("uninstalling the CNI plugin: %w", err)
	}
	if err := rules.DeleteHostRules(ctx); err != nil {
		return fmt.Errorf("removing host rules: %w", err)
	}
	return nil
}
