package cniinstall

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"
)

// Other writers of the conf dir, and how owned mode reaches a fixed point
// with each (docs/install.md, "Other writers of the conf dir"):
//
//   - a file that already holds our plugin (anywhere: in its chain, inside a
//     meta-plugin's delegates, or a copy of our owned file, marked) is never
//     copied: copying it is what makes two copiers nest each other;
//   - a meta-plugin's config (Multus) sorting first is the network the
//     runtime must run: the owned copy would shadow it, so the installer
//     inserts our entry into that file instead (in place, like Istio) and
//     removes the owned copy — unless the meta-plugin's cluster network
//     already runs our plugin (Multus took our copy as its master), then it
//     adds nothing;
//   - a primary that withdraws its config takes our copy with it.

// metaPluginTypes are meta-plugins that run a cluster network given as
// delegates: Multus's thin plugin ("delegates" embedded) and its thick
// shim ("clusterNetwork", a path the daemon reads).
var metaPluginTypes = []string{"multus", "multus-shim"}

// decoded is a config file's JSON, nil when it does not decode.
func decoded(data []byte) map[string]any {
	var v map[string]any
	if json.Unmarshal(data, &v) != nil {
		return nil
	}
	return v
}

// topPlugins are a config's plugins: a list's "plugins", or the config
// itself when it is a single plugin.
func topPlugins(v map[string]any) []map[string]any {
	raw, ok := v["plugins"].([]any)
	if !ok {
		return []map[string]any{v}
	}
	out := make([]map[string]any, 0, len(raw))
	for _, p := range raw {
		if m, ok := p.(map[string]any); ok {
			out = append(out, m)
		}
	}
	return out
}

// metaPlugin reports whether the config's first plugin is a meta-plugin.
func metaPlugin(data []byte) bool {
	v := decoded(data)
	if v == nil {
		return false
	}
	ps := topPlugins(v)
	return len(ps) > 0 && contains(metaPluginTypes, typeOf(ps[0]))
}

func typeOf(p map[string]any) string {
	s, _ := p["type"].(string)
	return s
}

// embeds reports whether data runs our plugin already inside it (in a
// delegate's chain, at any depth), is a copy of our owned file (marked), or
// names our owned file (a thick Multus's clusterNetwork path).
func (i *Installer) embeds(data []byte) bool {
	v := decoded(data)
	if v == nil {
		return false
	}
	if _, ok := v[ownedKey]; ok {
		return true
	}
	// Our entry in the file's own chain is in-place mode's (ours to take
	// out when copying); held anywhere deeper, the file runs us already.
	for _, p := range topPlugins(v) {
		for k, x := range p {
			if k != "type" && walk(i, x) {
				return true
			}
		}
	}
	for k, x := range v {
		if k != "plugins" && k != "type" && walk(i, x) {
			return true
		}
	}
	return false
}

// walk finds our plugin's type, or an absolute path naming our owned file,
// anywhere in x.
func walk(i *Installer, x any) bool {
	var walk func(x any) bool
	walk = func(x any) bool {
		switch t := x.(type) {
		case map[string]any:
			if s, _ := t["type"].(string); s == i.cfg.Entry.Type {
				return true
			}
			for _, y := range t {
				if walk(y) {
					return true
				}
			}
		case []any:
			for _, y := range t {
				if walk(y) {
					return true
				}
			}
		case string:
			return filepath.Base(t) == i.cfg.OwnedName && filepath.IsAbs(t)
		}
		return false
	}
	return walk(x)
}

// namesOwned: a meta-plugin that reads our owned file by path (thick
// Multus's clusterNetwork).
func (i *Installer) namesOwned(data []byte) bool {
	v := decoded(data)
	if v == nil {
		return false
	}
	for _, p := range topPlugins(v) {
		if s, ok := p["clusterNetwork"].(string); ok && filepath.Base(s) == i.cfg.OwnedName {
			return true
		}
	}
	return false
}

// runsUs counts our plugin in the chain one ADD runs through data: its
// plugins in order, a meta-plugin replaced by its embedded delegates. last
// says whether ours is the chain's last plugin.
func (i *Installer) runsUs(data []byte) (n int, last bool) {
	v := decoded(data)
	if v == nil {
		return 0, false
	}
	var chain []string
	var flat func(v map[string]any)
	flat = func(v map[string]any) {
		for _, p := range topPlugins(v) {
			if !contains(metaPluginTypes, typeOf(p)) {
				chain = append(chain, typeOf(p))
				continue
			}
			ds, _ := p["delegates"].([]any)
			for _, d := range ds {
				if dm, ok := d.(map[string]any); ok {
					flat(dm)
				}
			}
		}
	}
	flat(v)
	for _, t := range chain {
		if t == i.cfg.Entry.Type {
			n++
		}
	}
	return n, len(chain) > 0 && chain[len(chain)-1] == i.cfg.Entry.Type
}

// ownedCandidate is what owned mode does with the conf dir: the primary to
// copy, or the meta-plugin's file to insert into instead (meta), skipping
// files that already hold our plugin. ErrNoConfig when there is none.
func (i *Installer) ownedCandidate(confs []confFile) (c confFile, meta bool, err error) {
	if i.cfg.ConfName != "" {
		c, err := i.primary(confs)
		return c, err == nil && metaPlugin(c.data), err
	}
	rest := without(confs, i.cfg.OwnedName)
	for {
		c, err := runtimeChoice(i.cfg.ConfDir, rest)
		if err != nil {
			return c, false, err
		}
		if metaPlugin(c.data) {
			return c, true, nil
		}
		if !i.embeds(c.data) {
			return c, false, nil
		}
		i.log.Debug("not copying a CNI config that already holds our plugin", "path", c.path)
		rest = without(rest, c.name)
	}
}

// errThickAdopted: a thick Multus reads our owned copy as its cluster
// network while the copy sorts first, so the runtime runs our copy, not
// Multus.
func (i *Installer) errThickAdopted(meta confFile) error {
	return fmt.Errorf("%s (Multus) reads our copy %s as its cluster network, and our copy sorts first: the runtime bypasses Multus; restart Multus (it then takes the primary as its master and the agent inserts into Multus's file), or use in-place mode", meta.path, i.cfg.OwnedName)
}

// withdraw: owned mode found no primary to copy. When our copy is there
// and the primary stays away for WithdrawGrace, it was withdrawn (a CNI
// uninstall, a migration): the copy goes too, so the runtime stops getting
// the withdrawn network through us, and Check says why until a primary is
// back. Within the grace the copy stays (a primary rewriting its file as
// remove + write): the runtime keeps a config with our plugin throughout.
func (i *Installer) withdraw(confs []confFile, noConfig error) (bool, error) {
	owned, ok := find(confs, i.cfg.OwnedName)
	if !ok || !hasKey(owned.data, ownedKey) {
		i.primaryMissing = time.Time{}
		return false, noConfig
	}
	name := i.copied
	if name == "" {
		name = "(copied before the agent started)"
	}
	now := time.Now()
	if i.primaryMissing.IsZero() {
		i.primaryMissing = now
		i.log.Info("the primary CNI config is missing; keeping our copy of it until it is back or the grace ends", "primary", name, "grace", i.cfg.WithdrawGrace)
	}
	if left := i.cfg.WithdrawGrace - now.Sub(i.primaryMissing); left > 0 {
		return false, &withdrawPending{primary: name, left: left}
	}
	i.setWithdrawn(name) // before the copy goes: readiness never says installed without it
	if err := removeFile(owned.path, owned.snap); err != nil {
		return false, fmt.Errorf("removing our copy %s of the withdrawn primary: %w", owned.path, err)
	}
	i.step()
	if _, err := i.removeStaleCopies(confs); err != nil {
		return true, err
	}
	i.log.Warn("the primary CNI config was withdrawn; removed our copy of it", "primary", name, "path", owned.path, "took", now.Sub(i.primaryMissing).Round(time.Millisecond))
	i.primaryMissing = time.Time{}
	return true, noConfig
}

// removeStaleCopies removes our copies under names other than OwnedName
// (left by an earlier --cni-owned-config-name): one that sorts before the
// current copy would keep the runtime on a stale copy of a primary, one
// after it is clutter that names our plugin. Called only once the copy
// under OwnedName holds our plugin, or with a withdrawn primary's copy:
// the runtime never sees a config without our plugin because of it.
func (i *Installer) removeStaleCopies(confs []confFile) (bool, error) {
	removed := false
	for _, c := range confs {
		if c.name == i.cfg.OwnedName || c.err != nil || !c.list || !hasKey(c.data, ownedKey) || c.real != c.path {
			continue
		}
		if err := removeFile(c.path, c.snap); err != nil {
			return removed, fmt.Errorf("removing our copy %s left under an earlier owned config name: %w", c.path, err)
		}
		i.step()
		removed = true
		i.log.Info("removed our copy left under an earlier owned config name", "path", c.path, "to", i.cfg.OwnedName)
	}
	return removed, nil
}

// withdrawPending: the primary's config is missing and our copy of it
// stays until the grace ends; Run looks again then.
type withdrawPending struct {
	primary string
	left    time.Duration
}

// Unwrap: within the grace, as after it, there is no primary to copy.
func (e *withdrawPending) Unwrap() error { return ErrNoConfig }

func (e *withdrawPending) Error() string {
	return fmt.Sprintf("the primary CNI config %s is missing; our copy stays for %v unless it is back", e.primary, e.left.Round(time.Millisecond))
}

// behindMeta: the first config other than our copy is a meta-plugin's
// (Multus). The runtime must run it, so our plugin goes into it (in place,
// last) unless its cluster network already runs it, and our copy, which
// would shadow it, goes — after the insertion, so the runtime never sees a
// config without our plugin.
func (i *Installer) behindMeta(m confFile, confs []confFile) (bool, error) {
	owned, hasOwned := find(confs, i.cfg.OwnedName)
	hasOwned = hasOwned && hasKey(owned.data, ownedKey)
	if hasOwned && i.namesOwned(m.data) {
		return false, i.errThickAdopted(m)
	}
	changed := false
	top := 0
	for _, p := range topPlugins(decoded(m.data)) {
		if typeOf(p) == i.cfg.Entry.Type {
			top++
		}
	}
	n, _ := i.runsUs(m.data)
	switch {
	case n-top > 0 && top > 0: // its cluster network runs us: not twice
		wrote, err := editFile(m.real, m.snap, func(b []byte) ([]byte, error) {
			s, _, err := removeEntries(b, i.cfg.Entry.Type)
			return s, err
		})
		if err != nil {
			return wrote, fmt.Errorf("removing our second entry from %s: %w", m.path, err)
		}
		changed = wrote
	case n-top > 0:
		i.log.Debug("the meta-plugin's cluster network runs our plugin already", "path", m.path)
	case !m.list:
		if err := i.convert(m); err != nil {
			return true, err
		}
		return true, fmt.Errorf("converted %s: %w", m.path, errConflict) // look again
	default:
		wrote, err := editFile(m.real, m.snap, i.entryOnly)
		if err != nil {
			return wrote, fmt.Errorf("inserting into %s: %w", m.path, err)
		}
		if wrote {
			i.step()
			i.log.Info("inserted CNI plugin into the meta-plugin's config", "path", m.path)
		}
		changed = wrote
	}
	if hasOwned {
		if err := removeFile(owned.path, owned.snap); err != nil {
			return true, fmt.Errorf("removing our copy %s, which would shadow %s: %w", owned.path, m.path, err)
		}
		i.step()
		i.log.Info("removed our owned CNI config: a meta-plugin's config is the runtime's", "path", owned.path, "primary", m.path)
		changed = true
	}
	return changed, nil
}

// delegatesRunUs: a meta-plugin's delegates (its cluster network) run our
// plugin — Multus took our copy as its master.
func (i *Installer) delegatesRunUs(data []byte) bool {
	n, _ := i.runsUs(data)
	top := 0
	for _, p := range topPlugins(decoded(data)) {
		if typeOf(p) == i.cfg.Entry.Type {
			top++
		}
	}
	return n > top
}

// uninstallFromDelegates takes our plugin (and our copy's mark) out of the
// delegates of a meta-plugin's config, which Multus took from our copy: left
// there, every ADD through Multus would run a plugin that is gone. Multus
// does not regenerate the file (it waits for that master, our copy, to come
// back), so nobody else would. The file is re-encoded: Multus writes it by
// machine and reads it as JSON.
func (i *Installer) uninstallFromDelegates(c confFile) error {
	if _, err := editFile(c.real, c.snap, func(b []byte) ([]byte, error) {
		v := decoded(b)
		if v == nil {
			return nil, fmt.Errorf("%s is not a JSON object", c.path)
		}
		for _, p := range topPlugins(v) {
			ds, _ := p["delegates"].([]any)
			for _, d := range ds {
				dm, ok := d.(map[string]any)
				if !ok {
					continue
				}
				delete(dm, ownedKey)
				ps, ok := dm["plugins"].([]any)
				if !ok {
					continue
				}
				kept := ps[:0]
				for _, x := range ps {
					if xm, ok := x.(map[string]any); ok && typeOf(xm) == i.cfg.Entry.Type {
						continue
					}
					kept = append(kept, x)
				}
				dm["plugins"] = kept
			}
		}
		out, err := json.MarshalIndent(v, "", "    ")
		return append(out, '\n'), err
	}); err != nil {
		return fmt.Errorf("removing our plugin from the delegates of %s: %w", c.path, err)
	}
	i.log.Info("removed our plugin from the meta-plugin's cluster network", "path", c.path)
	return nil
}
