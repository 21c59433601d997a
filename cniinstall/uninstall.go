package cniinstall

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

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
