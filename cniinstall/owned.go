package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"time"
)

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
