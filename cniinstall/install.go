// Package cniinstall installs the chained CNI plugin on the node and keeps it
// installed: it copies the plugin binary into the host's CNI bin dir and
// makes the config the container runtime uses call it last — by default
// through a conflist of its own that sorts first (a copy of the primary
// CNI's config plus our entry: the primary rewriting its own file, as
// Calico, flannel and Cilium do at every start, cannot drop our plugin),
// or, in in-place mode, by inserting our entry into the primary's file.
// It watches both dirs (inotify; polling when inotify is unavailable) and
// repairs what others change, edits others' files compare-and-swap, keeps
// their owner, mode and xattrs, and reports whether the plugin is really
// in the runtime's config. Stopping leaves everything in place (an upgrade
// must not let ambient pods start uncaptured); only Uninstall removes what
// it installed, and never another component's entries.
package cniinstall

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ambientd/ambientd/cniapi"
)

// Defaults of Config.
const (
	DefaultOwnedName    = "00-ambientd.conflist"
	DefaultRepairWindow = time.Minute
	DefaultRepairLimit  = 5
	DefaultResync       = 30 * time.Second
	DefaultPollInterval = 2 * time.Second
	// DefaultWithdrawGrace is how long the primary's config may be missing
	// before owned mode takes it as withdrawn. A primary rewriting its
	// file as remove + write is back within milliseconds; removing our
	// copy in that gap would let the runtime see the new file alone, and
	// a pod created then would start without our plugin.
	DefaultWithdrawGrace = 5 * time.Second
)

// ErrNoConfig means the conf dir has no valid config yet (the node's primary
// CNI has not written one); Run waits for one.
var ErrNoConfig = errors.New("no valid CNI config in the conf dir yet")

// Entry is our plugin's entry in the conflist: its type and its own keys
// (cniapi.PluginSettings, the schema the plugin reads).
type Entry struct {
	Type string `json:"type"`
	cniapi.PluginSettings
}

// Config says where to install what. The zero value of every mode field is
// the default: owned mode.
type Config struct {
	// BinSource is the plugin binary to install (the one in the image).
	BinSource string
	// BinDir is the host's CNI bin dir as mounted (e.g. /host/opt/cni/bin).
	BinDir string
	// ConfDir is the host's CNI conf dir as mounted (e.g. /host/etc/cni/net.d).
	ConfDir string
	// ConfName, when set, is the primary config: the file to copy (owned
	// mode) or to insert into (in-place mode), instead of the lexically
	// first valid one.
	ConfName string
	// InPlace selects in-place mode: insert our entry into the primary's
	// own file. By default (owned mode) the installer writes OwnedName, a
	// copy of the primary config plus our entry, which sorts first, and
	// leaves the primary's file alone.
	InPlace   bool
	OwnedName string
	// Entry is what we insert; Entry.Type is also the binary's name.
	Entry Entry
	// More than RepairLimit repairs of external rewrites within
	// RepairWindow is a fight with another component: warn and back off.
	RepairWindow time.Duration
	RepairLimit  int
	// Resync re-checks everything periodically, in case an event was missed.
	Resync time.Duration
	// PollInterval is how often the dirs are re-read while inotify is not
	// available (instances exhausted, watcher failed).
	PollInterval time.Duration
	// WithdrawGrace is how long the primary's config may be missing before
	// owned mode removes our copy of it (DefaultWithdrawGrace).
	WithdrawGrace time.Duration
	// HostConfDir is ConfDir as the host names it (the plugin, which runs
	// on the host, reads it from the install lease); default ConfDir.
	HostConfDir string
	// LeaseTTL is the install lease's TTL (cniapi.InstallLease.TTL);
	// default cniapi.DefaultLeaseTTL.
	LeaseTTL time.Duration
	// DaemonSetNamespace/DaemonSetName and Policy go into the install
	// lease: what the plugin needs to decide while no agent answers.
	DaemonSetNamespace, DaemonSetName string
	Policy                            *cniapi.LeasePolicy
	// Credentials, when set, returns the plugin's kubeconfig (the agent's
	// own credentials), written beside the lease with mode 0600 at every
	// lease write when it changed (a rotated token).
	Credentials func() ([]byte, error)
}

// Validate checks the config and fills defaults; an error names the
// agent's flag that sets the field (`ambientd run`, `ambientd uninstall`).
func (c *Config) Validate() error {
	if c.Entry.Type == "" {
		c.Entry.Type = cniapi.PluginType
	}
	if c.OwnedName == "" {
		c.OwnedName = DefaultOwnedName
	}
	if c.RepairWindow <= 0 {
		c.RepairWindow = DefaultRepairWindow
	}
	if c.RepairLimit <= 0 {
		c.RepairLimit = DefaultRepairLimit
	}
	if c.Resync <= 0 {
		c.Resync = DefaultResync
	}
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.WithdrawGrace <= 0 {
		c.WithdrawGrace = DefaultWithdrawGrace
	}
	if c.HostConfDir == "" {
		c.HostConfDir = c.ConfDir
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = cniapi.DefaultLeaseTTL
	}
	// In a fixed order, each named by the agent's flag that sets it, so
	// with several bad ones the same is reported every time.
	for _, p := range []struct{ flag, path string }{{"cni-bin-source", c.BinSource}, {"cni-bin-dir", c.BinDir}, {"cni-conf-dir", c.ConfDir}, {"cni-host-conf-dir", c.HostConfDir}} {
		if !filepath.IsAbs(p.path) {
			return fmt.Errorf("--%s %q: must be an absolute path", p.flag, p.path)
		}
	}
	for _, n := range []struct{ what, name string }{{"--cni-conf-name", c.ConfName}, {"--cni-owned-config-name", c.OwnedName}, {"plugin type", c.Entry.Type}} {
		if strings.ContainsRune(n.name, '/') || n.name == "." || n.name == ".." {
			return fmt.Errorf("%s %q: must be a plain file name", n.what, n.name)
		}
	}
	if c.ConfName != "" && !contains(confExtensions, filepath.Ext(c.ConfName)) {
		return fmt.Errorf("--cni-conf-name %q: must end in .conf, .conflist or .json", c.ConfName)
	}
	if filepath.Ext(c.OwnedName) != ".conflist" {
		return fmt.Errorf("--cni-owned-config-name %q: must end in .conflist", c.OwnedName)
	}
	if !c.InPlace && c.ConfName == c.OwnedName {
		return fmt.Errorf("--cni-conf-name %q: the owned config's name too (--cni-owned-config-name)", c.OwnedName)
	}
	return nil
}

// Installer is the install-cni component.
type Installer struct {
	cfg Config
	log *slog.Logger
	mu  sync.Mutex // one pass or uninstall at a time
	bin binState   // under mu
	// copied is the primary config the owned file was last copied from
	// (under mu).
	copied string
	// primaryMissing is when owned mode first found no primary to copy
	// while our copy was there (zero: a primary is there; under mu).
	primaryMissing time.Time

	hmu    sync.Mutex
	health health

	// The install lease's state (lease.go).
	lmu          sync.Mutex
	uninstalling bool  // MarkUninstalling ran
	leaseGone    bool  // an uninstall removed the lease: never write it again
	leaseErr     error // the last lease (or kubeconfig) write's error

	// started is when the installer was made: configs a primary renamed
	// away after it are evidence of an exclusive primary (exclusive.go).
	started time.Time

	// stepped, for tests, runs after each change the installer makes to
	// the conf dir, so a test can look at the runtime's view in between.
	stepped func()
	// observe is told each Result (Observe).
	observe func(Result)
}

// step marks one change to the conf dir done (see stepped).
func (i *Installer) step() {
	if i.stepped != nil {
		i.stepped()
	}
}

// binState remembers the installed binary we verified, so a pass does not
// read two plugin binaries to compare them when nothing changed.
type binState struct {
	srcSum   [sha256.Size]byte
	srcSize  int64
	verified fileAttrs // the installed copy as last verified (identity)
}

// health is the outcome of the last passes: a failure makes Check (and so
// readiness) fail with its reason until a pass succeeds.
type health struct {
	err      error
	since    time.Time
	failures int
	mode     string // how changes are noticed: "inotify" or "polling: <why>"
	// withdrawn names the primary config whose withdrawal removed our
	// copy, until a primary is back.
	withdrawn string
}

// New validates cfg and returns the installer; nothing is touched yet.
func New(cfg Config, log *slog.Logger) (*Installer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Installer{cfg: cfg, log: log, started: time.Now()}, nil
}

// Config returns the validated config.
func (i *Installer) Config() Config { return i.cfg }

func (i *Installer) binPath() string { return filepath.Join(i.cfg.BinDir, i.cfg.Entry.Type) }

// maxRedo bounds how often one pass starts over because a file changed
// while it was changing it (errConflict).
const maxRedo = 5

// Install makes one pass: binary, then config. changed says whether it
// wrote anything. ErrNoConfig when there is no config to insert into yet.
func (i *Installer) Install() (changed bool, err error) {
	changed, _, err = i.install()
	return changed, err
}

// install is Install, also saying which step failed (BinaryFailed or
// ConfigFailed; 0 without an error).
func (i *Installer) install() (changed bool, failed Result, err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	binChanged, err := i.ensureBinary()
	if err != nil {
		return false, BinaryFailed, err
	}
	for redo := 0; ; redo++ {
		c, err := i.ensureConfig()
		changed = changed || c
		if !errors.Is(err, errConflict) || redo == maxRedo {
			if err != nil {
				failed = ConfigFailed
			}
			return binChanged || changed, failed, err
		}
		i.log.Debug("CNI config changed while we were changing it; starting over", "error", err)
	}
}

// Result is what an install round or a write of the plugin's kubeconfig
// came to, as Observe reports it (Istio's istio_cni_installs_total counts
// them).
type Result int

const (
	// Installed: a round of Run left the plugin installed: its first, and
	// each one that wrote something (a repair after another's change).
	Installed Result = iota + 1
	// BinaryFailed: a round could not install the plugin binary.
	BinaryFailed
	// ConfigFailed: a round could not write the CNI config.
	ConfigFailed
	// KubeconfigFailed: the plugin's kubeconfig could not be written.
	KubeconfigFailed
)

// Observe has f told of every Result from now on; call it before Run and
// RenewLease. A round that only waits for the node's primary config, or
// that another writer kept changing files under, reports nothing.
func (i *Installer) Observe(f func(Result)) { i.observe = f }

func (i *Installer) report(r Result) {
	if i.observe != nil && r != 0 {
		i.observe(r)
	}
}
