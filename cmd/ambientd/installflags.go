package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
)

// installFlags are the install-cni settings shared by `ambientd run`
// (with --install-cni) and `ambientd uninstall`.
type installFlags struct {
	binSource, binDir, confDir, confName, ownedName string
	hostConfDir                                     string
	leaseTTL                                        time.Duration
	owned                                           bool
	pluginLogLevel, pluginLogFile                   string
	pluginTimeout                                   time.Duration
	pollInterval, resync, repairWindow              time.Duration
	withdrawGrace                                   time.Duration
	repairLimit                                     int
	daemonSet, namespace                            string
	pluginServiceAccount                            string
	pluginTokenTTL                                  time.Duration
}

// namedValue is a flag's value with the flag's name, for checks that range
// over several flags in a fixed order.
type namedValue[T any] struct {
	flag  string
	value T
}

// register adds the install flags to fs.
func (f *installFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.binSource, "cni-bin-source", "", "the plugin binary to install (default: ambientd-cni beside this executable)")
	fs.StringVar(&f.binDir, "cni-bin-dir", "/host/opt/cni/bin", "the host's CNI bin dir, as mounted")
	fs.StringVar(&f.confDir, "cni-conf-dir", "/host/etc/cni/net.d", "the host's CNI conf dir, as mounted")
	fs.StringVar(&f.hostConfDir, "cni-host-conf-dir", "", "the host's CNI conf dir as the host names it, written into the install lease for the plugin (default: --cni-conf-dir without a leading /host)")
	fs.DurationVar(&f.leaseTTL, "cni-install-lease-ttl", cniapi.DefaultLeaseTTL, "with no agent on the node for this long (counted from the last start or renewal, or from the node's boot if later), a pod outside the mesh also asks the API whether the agent's DaemonSet still exists; never lets a mesh pod start by itself (docs/install.md)")
	fs.StringVar(&f.confName, "cni-conf-name", "", "config file to insert into (default: the lexically first valid .conf/.conflist/.json, as runtimes choose)")
	fs.BoolVar(&f.owned, "cni-owned-config", true, "write our own conflist that sorts first (a copy of the primary config plus our plugin), so a primary CNI rewriting its own file cannot drop our plugin; false = insert our plugin into the primary's file (in-place mode)")
	fs.StringVar(&f.ownedName, "cni-owned-config-name", cniinstall.DefaultOwnedName, "file name of the owned conflist; must sort before the primary's")
	fs.DurationVar(&f.pollInterval, "cni-poll-interval", cniinstall.DefaultPollInterval, "how often the installer re-reads the CNI dirs while it cannot watch them with inotify (instances exhausted, watcher lost)")
	fs.DurationVar(&f.resync, "cni-resync-interval", cniinstall.DefaultResync, "period of the installer's full re-check, in case a file event was missed")
	fs.IntVar(&f.repairLimit, "cni-repair-limit", cniinstall.DefaultRepairLimit, "repairs of external rewrites within --cni-repair-window above which the installer warns of a fight and backs off")
	fs.DurationVar(&f.repairWindow, "cni-repair-window", cniinstall.DefaultRepairWindow, "sliding window of --cni-repair-limit")
	fs.DurationVar(&f.withdrawGrace, "cni-withdraw-grace", cniinstall.DefaultWithdrawGrace, "owned mode: how long the primary's config may be missing before our copy of it is removed as withdrawn (a primary rewriting its file as remove + write is back sooner; our copy stays meanwhile, so the runtime never sees the primary's file without our plugin)")
	fs.StringVar(&f.pluginLogLevel, "cni-plugin-log-level", "info", "the plugin's logLevel in its config entry")
	fs.StringVar(&f.pluginLogFile, "cni-plugin-log-file", "", "the plugin's logFile on the host (default: stderr, i.e. the runtime's log)")
	fs.DurationVar(&f.pluginTimeout, "cni-plugin-timeout", cniapi.DefaultPluginTimeout, "the plugin's timeout for one ADD's call to the agent")
	fs.StringVar(&f.pluginServiceAccount, "cni-plugin-service-account", "", "the service account (in --daemonset-namespace) whose tokens the plugin reads the API with while no agent answers, minted by the agent (TokenRequest) so that they outlive its pod; empty: the agent's own credentials (docs/install.md)")
	fs.DurationVar(&f.pluginTokenTTL, "cni-plugin-token-ttl", 24*time.Hour, "the life of the plugin's minted token (10m to 168h); minted again when half of it is gone, so the plugin can read the API for at least half of it with no agent")
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
	if f.pluginTimeout < cniapi.MinPluginTimeout || f.pluginTimeout > cniapi.MaxPluginTimeout {
		return cniinstall.Config{}, fmt.Errorf("--cni-plugin-timeout %v: want %v to %v (the kubelet gives up on a sandbox after 2m)", f.pluginTimeout, cniapi.MinPluginTimeout, cniapi.MaxPluginTimeout)
	}
	// Below 100ms the installer's re-reads are most of its work; above an
	// hour a missed file event (a primary that dropped our entry) stays
	// unrepaired for longer than anyone would wait.
	for _, d := range []namedValue[time.Duration]{{"--cni-poll-interval", f.pollInterval}, {"--cni-resync-interval", f.resync}, {"--cni-repair-window", f.repairWindow}, {"--cni-withdraw-grace", f.withdrawGrace}} {
		if d.value < 100*time.Millisecond || d.value > time.Hour {
			return cniinstall.Config{}, fmt.Errorf("%s %v: want 100ms to 1h", d.flag, d.value)
		}
	}
	if f.pluginTokenTTL < 10*time.Minute || f.pluginTokenTTL > 168*time.Hour {
		return cniinstall.Config{}, fmt.Errorf("--cni-plugin-token-ttl %v: want 10m to 168h", f.pluginTokenTTL)
	}
	if f.leaseTTL < cniapi.MinLeaseTTL || f.leaseTTL > cniapi.MaxLeaseTTL {
		return cniinstall.Config{}, fmt.Errorf("--cni-install-lease-ttl %v: want %v to %v", f.leaseTTL, cniapi.MinLeaseTTL, cniapi.MaxLeaseTTL)
	}
	hostConfDir := f.hostConfDir
	if hostConfDir == "" {
		hostConfDir = f.confDir
		if rest, ok := strings.CutPrefix(f.confDir, "/host/"); ok {
			hostConfDir = "/" + rest
		}
	}
	if !filepath.IsAbs(hostConfDir) {
		return cniinstall.Config{}, fmt.Errorf("--cni-host-conf-dir %q: must be an absolute path", hostConfDir)
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
		WithdrawGrace: f.withdrawGrace,
		HostConfDir:   hostConfDir, LeaseTTL: f.leaseTTL,
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
