package cniinstall

import (
	"errors"
	"fmt"
	"os"
)

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
