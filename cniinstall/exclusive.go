package cniinstall

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// ErrExclusiveCNI marks a Check failure explained by a primary CNI that
// takes the conf dir over: Cilium with cni-exclusive=true renames every
// other CNI config (ours included) to NAME.cilium_bak and rewrites its own
// whenever the dir changes, so our config keeps disappearing (Cilium's
// daemon/cmd/cni/config.go, cleanupOtherCNI). The node condition names it
// (nodeready.ReasonExclusiveCNI).
var ErrExclusiveCNI = errors.New("a primary CNI in exclusive mode (Cilium's cni-exclusive=true) renames other CNI configs away")

// ciliumBackupSuffix is what Cilium appends to the configs it renames.
const ciliumBackupSuffix = ".cilium_bak"

// ciliumLegacyBackup is the one rename Cilium makes without cni-exclusive:
// its own old 05-cilium.conf, replaced by 05-cilium.conflist.
const ciliumLegacyBackup = "05-cilium.conf" + ciliumBackupSuffix

// exclusiveRenames returns the configs of dir that Cilium's cni-exclusive
// renamed away at or after since (the rename sets the file's ctime), by
// their original name. Older backups are leftovers of a past setting:
// Cilium never renames them back, so only a recent rename is evidence that
// exclusive mode is on now.
func exclusiveRenames(dir string, since time.Time) []string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var renamed []string
	for _, e := range entries {
		orig, ok := strings.CutSuffix(e.Name(), ciliumBackupSuffix)
		if !ok || e.Name() == ciliumLegacyBackup || !e.Type().IsRegular() {
			continue
		}
		fi, err := os.Lstat(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || time.Unix(st.Ctim.Sec, st.Ctim.Nsec).Before(since) {
			continue
		}
		renamed = append(renamed, orig)
	}
	slices.Sort(renamed)
	return renamed
}

// explainExclusive wraps a Check failure with ErrExclusiveCNI when Cilium's
// cni-exclusive renamed configs away since the installer started.
func (i *Installer) explainExclusive(err error) error {
	return ExplainExclusive(i.cfg.ConfDir, i.started, err)
}

// ExplainExclusive wraps err, a failed "plugin installed" check of conf
// dir dir, with ErrExclusiveCNI when Cilium's cni-exclusive renamed configs
// of dir away at or after since (the checker's start). nil stays nil.
func ExplainExclusive(dir string, since time.Time, err error) error {
	if err == nil {
		return nil
	}
	renamed := exclusiveRenames(dir, since)
	if len(renamed) == 0 {
		return err
	}
	return fmt.Errorf("%w: %s renamed to *%s since the agent started (set cni.exclusive=false in Cilium's Helm values, cni-exclusive: \"false\" in cilium-config): %w",
		ErrExclusiveCNI, strings.Join(renamed, ", "), ciliumBackupSuffix, err)
}
