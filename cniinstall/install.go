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
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
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

// Validate checks the config and fills defaults.
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
	for name, p := range map[string]string{"bin source": c.BinSource, "bin dir": c.BinDir, "conf dir": c.ConfDir, "host conf dir": c.HostConfDir} {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("cni install: %s %q must be an absolute path", name, p)
		}
	}
	for name, n := range map[string]string{"conf name": c.ConfName, "owned conf name": c.OwnedName, "plugin type": c.Entry.Type} {
		if strings.ContainsRune(n, '/') || n == "." || n == ".." {
			return fmt.Errorf("cni install: %s %q must be a plain file name", name, n)
		}
	}
	if c.ConfName != "" && !contains(confExtensions, filepath.Ext(c.ConfName)) {
		return fmt.Errorf("cni install: conf name %q must end in .conf, .conflist or .json", c.ConfName)
	}
	if filepath.Ext(c.OwnedName) != ".conflist" {
		return fmt.Errorf("cni install: owned conf name %q must end in .conflist", c.OwnedName)
	}
	if !c.InPlace && c.ConfName == c.OwnedName {
		return fmt.Errorf("cni install: conf name and owned conf name are both %q", c.OwnedName)
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

// ensureBinary copies BinSource into BinDir unless an identical copy is
// there: temp file + rename, so a runtime exec'ing it never sees half a file.
func (i *Installer) ensureBinary() (bool, error) {
	dst := i.binPath()
	if i.bin.srcSize == 0 {
		sum, size, err := hashFile(i.cfg.BinSource)
		if err != nil {
			return false, fmt.Errorf("reading plugin binary: %w", err)
		}
		i.bin.srcSum, i.bin.srcSize = sum, size
	}
	if have, err := statPath(dst); err == nil && have.mode&0o111 != 0 {
		if have.sameFile(i.bin.verified) {
			return false, nil
		}
		if sum, size, err := hashFile(dst); err == nil && size == i.bin.srcSize && sum == i.bin.srcSum {
			i.bin.verified = have
			return false, nil
		}
	}
	want, err := os.ReadFile(i.cfg.BinSource)
	if err != nil {
		return false, fmt.Errorf("reading plugin binary: %w", err)
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return false, fmt.Errorf("creating CNI bin dir: %w", err)
	}
	attrs := newFileAttrs()
	attrs.mode = 0o755
	if err := writeAtomic(dst, want, attrs); err != nil {
		return false, fmt.Errorf("installing plugin binary: %w", err)
	}
	i.bin.srcSum, i.bin.srcSize = sha256.Sum256(want), int64(len(want))
	if have, err := statPath(dst); err == nil {
		i.bin.verified = have
	}
	i.log.Info("installed CNI plugin binary", "path", dst, "bytes", len(want))
	return true, nil
}

func hashFile(path string) ([sha256.Size]byte, int64, error) {
	var sum [sha256.Size]byte
	f, err := os.Open(path)
	if err != nil {
		return sum, 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return sum, 0, err
	}
	copy(sum[:], h.Sum(nil))
	return sum, n, nil
}

// statPath is the identity and mode of path (following symlinks).
func statPath(path string) (fileAttrs, error) {
	f, err := os.Open(path)
	if err != nil {
		return fileAttrs{}, err
	}
	defer f.Close()
	return statAttrs(f)
}

func (i *Installer) entryOnly(data []byte) ([]byte, error) {
	stripped, _, err := removeEntries(data, i.cfg.Entry.Type)
	if err != nil {
		return nil, err
	}
	return appendEntry(stripped, i.cfg.Entry)
}

func (i *Installer) ensureConfig() (bool, error) {
	if err := os.MkdirAll(i.cfg.ConfDir, 0o755); err != nil {
		return false, fmt.Errorf("CNI conf dir: %w", err)
	}
	confs, err := listConfs(i.cfg.ConfDir)
	if err != nil {
		return false, err
	}
	if !i.cfg.InPlace {
		return i.ensureOwned(confs)
	}
	// Back from owned mode: our owned file, which the runtime uses, goes
	// only once the primary's file has our entry — the runtime never sees
	// a config without our plugin.
	owned, hasOwned := find(confs, i.cfg.OwnedName)
	if hasOwned = hasOwned && hasKey(owned.data, ownedKey); hasOwned {
		confs = without(confs, owned.name)
	}
	target, err := i.primary(confs)
	if err != nil {
		return false, err
	}
	if !target.list {
		if err := i.convert(target); err != nil {
			return true, err
		}
		if hasOwned { // look again: the converted list is the target now
			return true, fmt.Errorf("converted %s: %w", target.path, errConflict)
		}
		return true, nil
	}
	wrote, err := editFile(target.real, target.snap, i.entryOnly)
	if wrote {
		i.step()
		i.log.Info("inserted CNI plugin into config", "path", target.path, "real_path", target.real)
	}
	if err != nil {
		return wrote, fmt.Errorf("inserting into %s: %w", target.path, err)
	}
	if hasOwned {
		if err := os.Remove(owned.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return true, fmt.Errorf("removing owned config %s: %w", owned.path, err)
		}
		i.step()
		i.log.Info("removed owned CNI config (in-place mode)", "path", owned.path)
		return true, nil
	}
	return wrote, nil
}

// primary is the primary CNI's config: ConfName, or the first valid file
// other than our owned one.
func (i *Installer) primary(confs []confFile) (confFile, error) {
	if i.cfg.ConfName != "" {
		c, ok := find(confs, i.cfg.ConfName)
		if !ok {
			return c, fmt.Errorf("%w: %s not found", ErrNoConfig, i.cfg.ConfName)
		}
		if c.unknown {
			return c, c.err
		}
		if !c.valid() {
			return c, fmt.Errorf("%w: %s is invalid: %v", ErrNoConfig, c.path, c.err)
		}
		return c, nil
	}
	for _, c := range confs {
		if !c.valid() {
			i.log.Debug("skipping invalid CNI config", "path", c.path, "error", c.err)
		}
	}
	var skip []string
	if !i.cfg.InPlace {
		skip = []string{i.cfg.OwnedName}
	}
	return runtimeChoice(i.cfg.ConfDir, confs, skip...)
}

// convert replaces a single-plugin config by a conflist of the same base
// name holding it verbatim plus our entry, with the .conf's owner, mode and
// xattrs; the .conf goes (it would sort before the .conflist) — but only if
// the primary has not written it again meanwhile.
func (i *Installer) convert(c confFile) error {
	if c.real != c.path {
		return fmt.Errorf("cannot convert %s to a conflist: it is a symlink (to %s), which converting would replace by a file; use owned mode (the default)", c.path, c.real)
	}
	dst := strings.TrimSuffix(c.path, filepath.Ext(c.path)) + ".conflist"
	list, err := listFromConf(c.data, convertedKey, c.name)
	if err != nil {
		return fmt.Errorf("converting %s: %w", c.path, err)
	}
	want, err := i.entryOnly(list)
	if err != nil {
		return fmt.Errorf("converting %s: %w", c.path, err)
	}
	existing, err := readSnapshot(dst)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		err = createFile(dst, want, c.snap.attrs)
	case err != nil:
		return fmt.Errorf("cannot convert %s: %w", c.path, err)
	case !hasKey(existing.data, convertedKey):
		return fmt.Errorf("cannot convert %s: %s exists and is not ours", c.path, dst)
	default: // ours, from an earlier conversion of this .conf
		if !bytes.Equal(existing.data, want) || !existing.attrs.keeps(c.snap.attrs) {
			err = writeAtomic(dst, want, c.snap.attrs)
		}
	}
	if err != nil {
		return err
	}
	i.step()
	if err := removeFile(c.path, c.snap); err != nil {
		return fmt.Errorf("removing %s after converting it to %s: %w", c.path, dst, err)
	}
	i.step()
	i.log.Info("converted CNI config to a conflist with our plugin", "from", c.path, "to", dst)
	return nil
}

// ensureOwned writes OwnedName = primary + our entry, marked as ours, and
// then takes what in-place mode left in the primary's config out of it (our
// entry; a .conf converted to a conflist comes back) — in that order, so
// that the runtime never sees a config without our plugin.
func (i *Installer) ensureOwned(confs []confFile) (bool, error) {
	p, meta, err := i.ownedCandidate(confs)
	if errors.Is(err, ErrNoConfig) {
		return i.withdraw(confs, err)
	}
	if err != nil {
		return false, err
	}
	i.primaryMissing = time.Time{}
	i.setWithdrawn("")
	if meta {
		return i.behindMeta(p, confs)
	}
	if p.name < i.cfg.OwnedName {
		return false, fmt.Errorf("owned config %s would not be used: %s sorts before it; choose an owned name that sorts first", i.cfg.OwnedName, p.name)
	}
	var base []byte
	var cleanup func() error // undoes in-place mode's change to the primary
	switch {
	case p.list:
		stripped, n, err := removeEntries(p.data, i.cfg.Entry.Type)
		if err != nil {
			return false, fmt.Errorf("reading %s: %w", p.path, err)
		}
		if from := stringKey(p.data, convertedKey); from != "" && p.real == p.path {
			if orig, ok := confFromList(stripped); ok {
				// In-place mode converted the primary's .conf: copy the
				// .conf, then put it back.
				if base, err = listFromConf(orig, ownedKey, true); err != nil {
					return false, fmt.Errorf("copying %s: %w", p.path, err)
				}
				cleanup = func() error { return i.uninstallFrom(p, confs) }
				break
			}
		}
		base = markOwned(stripped)
		if n > 0 {
			cleanup = func() error {
				_, err := editFile(p.real, p.snap, func(b []byte) ([]byte, error) {
					s, _, err := removeEntries(b, i.cfg.Entry.Type)
					return s, err
				})
				if err == nil {
					i.step()
					i.log.Info("removed our plugin from the primary config (owned mode)", "path", p.path)
				}
				return err
			}
		}
	default:
		if base, err = listFromConf(p.data, ownedKey, true); err != nil {
			return false, fmt.Errorf("copying %s: %w", p.path, err)
		}
	}
	want, err := appendEntry(base, i.cfg.Entry)
	if err != nil {
		return false, fmt.Errorf("copying %s: %w", p.path, err)
	}
	changed, err := i.writeOwned(want, ownedAttrs(p.snap.attrs), p.path)
	if err == nil {
		i.copied = p.name
		var removed bool
		removed, err = i.removeStaleCopies(confs)
		changed = changed || removed
	}
	if err != nil || cleanup == nil {
		return changed, err
	}
	if err := cleanup(); err != nil {
		return true, fmt.Errorf("undoing in-place mode's change to %s: %w", p.path, err)
	}
	// Copy what the primary holds now.
	return true, fmt.Errorf("undid in-place mode's change to %s: %w", p.path, errConflict)
}

// writeOwned makes the owned file hold want with attrs, unless it does.
func (i *Installer) writeOwned(want []byte, attrs fileAttrs, primary string) (bool, error) {
	dst := filepath.Join(i.cfg.ConfDir, i.cfg.OwnedName)
	have, err := readSnapshot(dst)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return false, fmt.Errorf("owned config: %w", err)
	case !hasKey(have.data, ownedKey):
		return false, fmt.Errorf("owned config %s exists and is not ours (no %q mark): not replacing it; remove it or choose another --cni-owned-config-name", dst, ownedKey)
	case bytes.Equal(have.data, want) && have.attrs.keeps(attrs):
		return false, nil
	}
	if err := writeAtomic(dst, want, attrs); err != nil {
		return false, err
	}
	i.step()
	i.log.Info("wrote owned CNI config", "path", dst, "primary", primary)
	return true, nil
}

// ownedAttrs are the owned config's attributes: the primary's owner, group
// and xattrs (its SELinux label is one the runtime can read), and its mode
// without group and other bits — the file names the agent's socket (Istio
// writes its configs 0600 since 1.30).
func ownedAttrs(primary fileAttrs) fileAttrs {
	a := primary
	a.mode = primary.mode & 0o700
	a.mode |= 0o600
	return a
}

// markOwned adds the owned mark as the first key of a conflist object.
func markOwned(list []byte) []byte {
	k := bytes.IndexByte(list, '{')
	return splice(list, k+1, k+1, []byte("\n  \""+ownedKey+"\": true,"))
}

func find(confs []confFile, name string) (confFile, bool) {
	for _, c := range confs {
		if c.name == name {
			return c, true
		}
	}
	return confFile{}, false
}

func without(confs []confFile, name string) []confFile {
	out := confs[:0:0]
	for _, c := range confs {
		if c.name != name {
			out = append(out, c)
		}
	}
	return out
}

// Check reports whether the plugin is really installed and kept installed:
// the installer's last pass did not fail, the binary is in BinDir,
// executable, and the config the runtime uses right now — the first valid
// file of the conf dir, whatever the mode or --cni-conf-name — has our
// entry last. nil means installed.
func (i *Installer) Check() error {
	if err := i.healthErr(); err != nil {
		return err
	}
	if err := i.checkRuntimeConfig(); err != nil {
		return i.explainExclusive(err)
	}
	return nil
}

// checkRuntimeConfig is Check but for its explanation.
func (i *Installer) checkRuntimeConfig() error {
	fi, err := os.Stat(i.binPath())
	if err != nil {
		return fmt.Errorf("plugin binary: %w", err)
	}
	if fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("plugin binary %s is not executable", i.binPath())
	}
	confs, err := listConfs(i.cfg.ConfDir)
	if err != nil {
		return err
	}
	active, err := runtimeChoice(i.cfg.ConfDir, confs)
	if err != nil {
		if w := i.withdrawnPrimary(); w != "" && errors.Is(err, ErrNoConfig) {
			return fmt.Errorf("the primary CNI config %s was withdrawn: our copy of it is removed too, so the runtime no longer gets that network through us; waiting for a primary CNI config: %w", w, err)
		}
		return err
	}
	if metaPlugin(active.data) {
		// Multus: our plugin once, last, in what one ADD runs.
		if n, last := i.runsUs(active.data); n != 1 || !last {
			return fmt.Errorf("runtime's config %s (a meta-plugin) runs %s %d times per ADD (last: %v), want once, last", active.path, i.cfg.Entry.Type, n, last)
		}
		return nil
	}
	hint := ""
	if i.cfg.ConfName != "" && active.name != i.cfg.ConfName {
		hint = fmt.Sprintf(" (it sorts before --cni-conf-name %s)", i.cfg.ConfName)
	}
	if !active.list {
		return fmt.Errorf("runtime's config %s is a single plugin, without ours%s", active.path, hint)
	}
	l, err := parseList(active.data)
	if err != nil {
		return fmt.Errorf("runtime's config %s: %w", active.path, err)
	}
	last := l.elems[len(l.elems)-1]
	if pluginType(active.data[last.start:last.end]) != i.cfg.Entry.Type {
		return fmt.Errorf("runtime's config %s does not have %s as its last plugin%s", active.path, i.cfg.Entry.Type, hint)
	}
	return nil
}

// Uninstall removes what the installer put on the node: our entry from every
// config (restoring a converted .conf byte for byte), our owned config, then
// the binary (last, so a runtime never calls a missing plugin) and the
// install lease. Other
// components' entries and files are not touched; edits are compare-and-swap
// and keep owner, mode and xattrs. Absent is fine.
func (i *Installer) Uninstall() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.uninstallConfs(); err != nil {
		// A config naming a missing plugin fails every later ADD on the
		// node, with nothing left to recover it: keep the binary (and the
		// lease, so that a plugin can finish the job) while any may.
		return fmt.Errorf("%w; the plugin binary stays while a config may still name it", err)
	}
	var errs []error
	if err := os.Remove(i.binPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing plugin binary: %w", err))
	}
	i.bin = binState{}
	if err := i.removeLease(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// namesPlugin reports whether a config of the conf dir names the plugin
// (Entry.Type) among its plugins.
func (i *Installer) namesPlugin() (bool, error) {
	confs, err := listConfs(i.cfg.ConfDir)
	if err != nil {
		return false, err
	}
	for _, c := range confs {
		if !c.list {
			if stringKey(c.data, "type") == i.cfg.Entry.Type {
				return true, nil
			}
			continue
		}
		if _, n, err := removeEntries(c.data, i.cfg.Entry.Type); err == nil && n > 0 {
			return true, nil
		}
	}
	return false, nil
}

// uninstallConfs removes our entries and files from the conf dir (under
// mu), starting over when another writer changed a file meanwhile.
func (i *Installer) uninstallConfs() error {
	var errs []error
	for redo := 0; ; redo++ {
		confs, err := listConfs(i.cfg.ConfDir)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		errs = errs[:0]
		conflict := false
		for _, c := range confs {
			if err := i.uninstallFrom(c, confs); err != nil {
				conflict = conflict || errors.Is(err, errConflict)
				errs = append(errs, err)
			}
		}
		if !conflict || redo == maxRedo {
			return errors.Join(errs...)
		}
	}
}

func (i *Installer) uninstallFrom(c confFile, all []confFile) error {
	if c.unknown {
		return fmt.Errorf("cannot check %s for our plugin: %w", c.path, c.err)
	}
	if c.err == nil && metaPlugin(c.data) && i.delegatesRunUs(c.data) {
		if err := i.uninstallFromDelegates(c); err != nil {
			return err
		}
		return fmt.Errorf("took our plugin out of the delegates of %s: %w", c.path, errConflict) // look again
	}
	if !c.list || c.err != nil {
		return nil
	}
	if hasKey(c.data, ownedKey) { // our copy, under OwnedName or an earlier name
		if err := os.Remove(c.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("removing owned config: %w", err)
		}
		i.log.Info("removed owned CNI config", "path", c.path)
		return nil
	}
	stripped, n, err := removeEntries(c.data, i.cfg.Entry.Type)
	if err != nil {
		return fmt.Errorf("removing our plugin from %s: %w", c.path, err)
	}
	if from := stringKey(c.data, convertedKey); from != "" && !strings.ContainsRune(from, '/') && c.real == c.path {
		if orig, ok := confFromList(stripped); ok {
			return i.restoreConverted(c, from, orig, all)
		}
	}
	if n == 0 {
		return nil
	}
	if _, err := editFile(c.real, c.snap, func(b []byte) ([]byte, error) {
		s, _, err := removeEntries(b, i.cfg.Entry.Type)
		return s, err
	}); err != nil {
		return fmt.Errorf("removing our plugin from %s: %w", c.path, err)
	}
	i.log.Info("removed our plugin from CNI config", "path", c.path, "real_path", c.real)
	return nil
}

// restoreConverted puts a converted .conf back as it was (text, owner, mode,
// xattrs) and removes the conflist made from it; when the primary CNI has
// written the .conf again meanwhile, the conflist is a stale copy and just
// goes.
func (i *Installer) restoreConverted(c confFile, from string, orig []byte, all []confFile) error {
	conf := filepath.Join(i.cfg.ConfDir, from)
	if _, exists := find(all, from); !exists {
		if err := createFile(conf, orig, c.snap.attrs); err != nil {
			return err
		}
		i.step()
	}
	if err := removeFile(c.path, c.snap); err != nil {
		return fmt.Errorf("removing converted config: %w", err)
	}
	i.step()
	i.log.Info("restored single-plugin CNI config", "path", conf, "removed", c.path)
	return nil
}
