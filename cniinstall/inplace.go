package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// In-place mode: our entry inserted last into the primary's own config
// (a single-plugin .conf converted to a conflist first).

// entryOnly is data with our entry as its last plugin, once.
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
