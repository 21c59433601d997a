// Package cniinstall installs the chained CNI plugin on the node and keeps it
// installed: it copies the plugin binary into the host's CNI bin dir, inserts
// the plugin as the last entry of the config the container runtime uses (or,
// in owned mode, writes its own conflist that sorts first), watches both and
// repairs them when another component rewrites them, and reports whether the
// plugin is really in the runtime's config. Stopping leaves everything in
// place (an upgrade must not let ambient pods start uncaptured); only
// Uninstall removes what it installed, and never another component's entries.
package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Defaults of Config.
const (
	DefaultPluginType   = "ambientd-cni"
	DefaultOwnedName    = "00-ambientd.conflist"
	DefaultRepairWindow = time.Minute
	DefaultRepairLimit  = 5
	DefaultResync       = 30 * time.Second
)

// ErrNoConfig means the conf dir has no valid config yet (the node's primary
// CNI has not written one); Run waits for one.
var ErrNoConfig = errors.New("no valid CNI config in the conf dir yet")

// Entry is our plugin's entry in the conflist (see cniplugin.Config).
type Entry struct {
	Type              string   `json:"type"`
	AgentSocket       string   `json:"agentSocket,omitempty"`
	Timeout           string   `json:"timeout,omitempty"`
	ExcludeNamespaces []string `json:"excludeNamespaces,omitempty"`
	LogLevel          string   `json:"logLevel,omitempty"`
	LogFile           string   `json:"logFile,omitempty"`
}

// Config says where to install what.
type Config struct {
	// BinSource is the plugin binary to install (the one in the image).
	BinSource string
	// BinDir is the host's CNI bin dir as mounted (e.g. /host/opt/cni/bin).
	BinDir string
	// ConfDir is the host's CNI conf dir as mounted (e.g. /host/etc/cni/net.d).
	ConfDir string
	// ConfName, when set, is the config file to insert into instead of the
	// lexically first valid one (in owned mode: the primary to copy).
	ConfName string
	// Owned selects owned mode: write OwnedName, a copy of the primary
	// config plus our plugin, which sorts first; the primary is not edited.
	Owned     bool
	OwnedName string
	// Entry is what we insert; Entry.Type is also the binary's name.
	Entry Entry
	// More than RepairLimit repairs of external rewrites within
	// RepairWindow is a fight with another component: warn and back off.
	RepairWindow time.Duration
	RepairLimit  int
	// Resync re-checks everything periodically, in case an event was missed.
	Resync time.Duration
}

// Validate checks the config and fills defaults.
func (c *Config) Validate() error {
	if c.Entry.Type == "" {
		c.Entry.Type = DefaultPluginType
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
	for name, p := range map[string]string{"bin source": c.BinSource, "bin dir": c.BinDir, "conf dir": c.ConfDir} {
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
	if c.Owned && c.ConfName == c.OwnedName {
		return fmt.Errorf("cni install: conf name and owned conf name are both %q", c.OwnedName)
	}
	return nil
}

// Installer is the install-cni component.
type Installer struct {
	cfg Config
	log *slog.Logger
	mu  sync.Mutex // one reconcile or uninstall at a time
}

// New validates cfg and returns the installer; nothing is touched yet.
func New(cfg Config, log *slog.Logger) (*Installer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Installer{cfg: cfg, log: log}, nil
}

// Config returns the validated config.
func (i *Installer) Config() Config { return i.cfg }

func (i *Installer) binPath() string { return filepath.Join(i.cfg.BinDir, i.cfg.Entry.Type) }

// Install makes one pass: binary, then config. changed says whether it
// wrote anything. ErrNoConfig when there is no config to insert into yet.
func (i *Installer) Install() (changed bool, err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	binChanged, err := i.ensureBinary()
	if err != nil {
		return false, err
	}
	confChanged, err := i.ensureConfig()
	return binChanged || confChanged, err
}

// ensureBinary copies BinSource into BinDir unless an identical copy is
// there: temp file + rename, so a runtime exec'ing it never sees half a file.
func (i *Installer) ensureBinary() (bool, error) {
	want, err := os.ReadFile(i.cfg.BinSource)
	if err != nil {
		return false, fmt.Errorf("reading plugin binary: %w", err)
	}
	dst := i.binPath()
	if have, err := os.ReadFile(dst); err == nil && bytes.Equal(have, want) {
		if fi, err := os.Stat(dst); err == nil && fi.Mode().Perm()&0o111 != 0 {
			return false, nil
		}
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return false, fmt.Errorf("creating CNI bin dir: %w", err)
	}
	if err := writeAtomic(dst, want, 0o755); err != nil {
		return false, fmt.Errorf("installing plugin binary: %w", err)
	}
	i.log.Info("installed CNI plugin binary", "path", dst, "bytes", len(want))
	return true, nil
}

func (i *Installer) entryOnly(data []byte) ([]byte, error) {
	stripped, _, err := removeEntries(data, i.cfg.Entry.Type)
	if err != nil {
		return nil, err
	}
	return appendEntry(stripped, i.cfg.Entry)
}

func (i *Installer) ensureConfig() (bool, error) {
	confs, err := listConfs(i.cfg.ConfDir)
	if err != nil {
		return false, err
	}
	if i.cfg.Owned {
		return i.ensureOwned(confs)
	}
	changed := false
	// Back from owned mode: our owned file would shadow the primary.
	if c, ok := find(confs, i.cfg.OwnedName); ok && hasKey(c.data, ownedKey) {
		if err := os.Remove(c.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return false, fmt.Errorf("removing owned config %s: %w", c.path, err)
		}
		i.log.Info("removed owned CNI config (owned mode is off)", "path", c.path)
		changed = true
		confs = without(confs, c.name)
	}
	target, err := i.primary(confs)
	if err != nil {
		return changed, err
	}
	if !target.list {
		return true, i.convert(target)
	}
	want, err := i.entryOnly(target.data)
	if err != nil {
		return changed, fmt.Errorf("inserting into %s: %w", target.path, err)
	}
	if bytes.Equal(want, target.data) {
		return changed, nil
	}
	if err := writeAtomic(target.path, want, target.mode); err != nil {
		return changed, err
	}
	i.log.Info("inserted CNI plugin into config", "path", target.path)
	return true, nil
}

// primary is the config the runtime uses (ConfName, or the first valid file
// other than our owned one).
func (i *Installer) primary(confs []confFile) (confFile, error) {
	if i.cfg.ConfName != "" {
		c, ok := find(confs, i.cfg.ConfName)
		if !ok {
			return c, fmt.Errorf("%w: %s not found", ErrNoConfig, i.cfg.ConfName)
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
	c, ok := firstValid(confs, i.ownedNameIfOwned()...)
	if !ok {
		return c, fmt.Errorf("%w (%s)", ErrNoConfig, i.cfg.ConfDir)
	}
	return c, nil
}

func (i *Installer) ownedNameIfOwned() []string {
	if i.cfg.Owned {
		return []string{i.cfg.OwnedName}
	}
	return nil
}

// convert replaces a single-plugin config by a conflist of the same base
// name holding it verbatim plus our entry; the .conf goes (it would sort
// before the .conflist).
func (i *Installer) convert(c confFile) error {
	dst := strings.TrimSuffix(c.path, filepath.Ext(c.path)) + ".conflist"
	if existing := readConf(dst); existing.err == nil || !errors.Is(existing.err, fs.ErrNotExist) {
		if !hasKey(existing.data, convertedKey) {
			return fmt.Errorf("cannot convert %s: %s exists and is not ours", c.path, dst)
		}
	}
	list, err := listFromConf(c.data, convertedKey, c.name)
	if err != nil {
		return fmt.Errorf("converting %s: %w", c.path, err)
	}
	want, err := i.entryOnly(list)
	if err != nil {
		return fmt.Errorf("converting %s: %w", c.path, err)
	}
	if err := writeAtomic(dst, want, c.mode); err != nil {
		return err
	}
	if err := os.Remove(c.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing %s after converting it to %s: %w", c.path, dst, err)
	}
	i.log.Info("converted CNI config to a conflist with our plugin", "from", c.path, "to", dst)
	return nil
}

// ensureOwned writes OwnedName = primary + our entry, marked as ours, and
// takes our entry out of the primary (left from non-owned mode).
func (i *Installer) ensureOwned(confs []confFile) (bool, error) {
	p, err := i.primary(confs)
	if err != nil {
		return false, err
	}
	if p.name < i.cfg.OwnedName {
		return false, fmt.Errorf("owned config %s would not be used: %s sorts before it; choose an owned name that sorts first", i.cfg.OwnedName, p.name)
	}
	changed := false
	var base []byte
	if p.list {
		stripped, n, err := removeEntries(p.data, i.cfg.Entry.Type)
		if err != nil {
			return false, fmt.Errorf("reading %s: %w", p.path, err)
		}
		if n > 0 {
			if err := writeAtomic(p.path, stripped, p.mode); err != nil {
				return false, err
			}
			i.log.Info("removed our plugin from the primary config (owned mode)", "path", p.path)
			changed = true
		}
		base = markOwned(stripped)
	} else {
		if base, err = listFromConf(p.data, ownedKey, true); err != nil {
			return changed, fmt.Errorf("copying %s: %w", p.path, err)
		}
	}
	want, err := appendEntry(base, i.cfg.Entry)
	if err != nil {
		return changed, fmt.Errorf("copying %s: %w", p.path, err)
	}
	dst := filepath.Join(i.cfg.ConfDir, i.cfg.OwnedName)
	mode := os.FileMode(0o600)
	if have, ok := find(confs, i.cfg.OwnedName); ok {
		if bytes.Equal(have.data, want) {
			return changed, nil
		}
		mode = have.mode
	}
	if err := writeAtomic(dst, want, mode); err != nil {
		return changed, err
	}
	i.log.Info("wrote owned CNI config", "path", dst, "primary", p.path)
	return true, nil
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

// Check reports whether the plugin is really installed: the binary is in
// BinDir, executable, and the config the runtime uses (the first valid one,
// or ConfName) has our entry last. nil means installed.
func (i *Installer) Check() error {
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
	var active confFile
	if i.cfg.ConfName != "" && !i.cfg.Owned {
		c, ok := find(confs, i.cfg.ConfName)
		if !ok || !c.valid() {
			return fmt.Errorf("config %s missing or invalid", filepath.Join(i.cfg.ConfDir, i.cfg.ConfName))
		}
		active = c
	} else {
		c, ok := firstValid(confs)
		if !ok {
			return fmt.Errorf("%w (%s)", ErrNoConfig, i.cfg.ConfDir)
		}
		active = c
	}
	if !active.list {
		return fmt.Errorf("runtime's config %s is a single plugin, without ours", active.path)
	}
	l, err := parseList(active.data)
	if err != nil {
		return fmt.Errorf("runtime's config %s: %w", active.path, err)
	}
	last := l.elems[len(l.elems)-1]
	if pluginType(active.data[last.start:last.end]) != i.cfg.Entry.Type {
		return fmt.Errorf("runtime's config %s does not have %s as its last plugin", active.path, i.cfg.Entry.Type)
	}
	return nil
}

// Ready is Check as a readiness answer for /readyz and the node condition.
func (i *Installer) Ready() (bool, string) {
	if err := i.Check(); err != nil {
		return false, "CNI plugin not installed: " + err.Error()
	}
	return true, "CNI plugin installed"
}

// Uninstall removes what the installer put on the node: our entry from every
// config (restoring a converted .conf byte for byte), our owned config, then
// the binary (last, so a runtime never calls a missing plugin). Other
// components' entries and files are not touched. Absent is fine.
func (i *Installer) Uninstall() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	confs, err := listConfs(i.cfg.ConfDir)
	if err != nil {
		return err
	}
	var errs []error
	for _, c := range confs {
		if err := i.uninstallFrom(c, confs); err != nil {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(i.binPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing plugin binary: %w", err))
	}
	return errors.Join(errs...)
}

func (i *Installer) uninstallFrom(c confFile, all []confFile) error {
	if !c.list || c.err != nil {
		return nil
	}
	if c.name == i.cfg.OwnedName && hasKey(c.data, ownedKey) {
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
	if from := stringKey(c.data, convertedKey); from != "" && !strings.ContainsRune(from, '/') {
		if orig, ok := confFromList(stripped); ok {
			return i.restoreConverted(c, from, orig, all)
		}
	}
	if n == 0 {
		return nil
	}
	if err := writeAtomic(c.path, stripped, c.mode); err != nil {
		return err
	}
	i.log.Info("removed our plugin from CNI config", "path", c.path)
	return nil
}

// restoreConverted puts a converted .conf back as it was and removes the
// conflist made from it; when the primary CNI has written the .conf again
// meanwhile, the conflist is a stale copy and just goes.
func (i *Installer) restoreConverted(c confFile, from string, orig []byte, all []confFile) error {
	if _, exists := find(all, from); !exists {
		if err := writeAtomic(filepath.Join(i.cfg.ConfDir, from), orig, c.mode); err != nil {
			return err
		}
	}
	if err := os.Remove(c.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing converted config: %w", err)
	}
	i.log.Info("restored single-plugin CNI config", "path", filepath.Join(i.cfg.ConfDir, from), "removed", c.path)
	return nil
}
