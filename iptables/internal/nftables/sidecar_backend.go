package nftables

import (
	"context"
	"slices"
	"sync"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// sidecarCache keeps the prepared sidecar rule sets per options (a node's
// sidecar pods share a few option sets).
type sidecarCache struct {
	mu   sync.Mutex
	sets map[string]RuleSet
}

var maxSidecarSets = 256

func (b *Backend) sidecarRules(o rules.SidecarOptions) (RuleSet, error) {
	k := o.Key()
	b.sidecar.mu.Lock()
	rs, ok := b.sidecar.sets[k]
	b.sidecar.mu.Unlock()
	if ok {
		return rs, nil
	}
	rs, err := prepare(BuildSidecarRules(o))
	if err != nil {
		return rs, err
	}
	b.sidecar.mu.Lock()
	if b.sidecar.sets == nil || len(b.sidecar.sets) >= maxSidecarSets {
		b.sidecar.sets = map[string]RuleSet{}
	}
	b.sidecar.sets[k] = rs
	b.sidecar.mu.Unlock()
	return rs, nil
}

// sidecarDiff is rs.diff plus the sidecar tables present that rs does not
// want (a table exists only while it has rules).
func sidecarDiff(rs RuleSet, st map[string]*tableState) (rules.Drift, error) {
	d, err := rs.diff(st)
	for name := range st {
		if !slices.Contains(rs.TableNames(), name) {
			d.Unexpected = append(d.Unexpected, "nft inet "+name+": table")
		}
	}
	return d, err
}

// ApplySidecar makes the namespace's istio-proxy-* tables exactly o's in
// one transaction (tables not wanted deleted, wanted ones rewritten), or
// writes nothing when they already are.
func (b *Backend) ApplySidecar(ctx context.Context, o rules.SidecarOptions, _ *rules.SidecarOptions, v rules.View) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	rs, err := b.sidecarRules(o)
	if err != nil {
		return err
	}
	nv := view(v)
	c, done, err := b.open(nv)
	if err != nil {
		return err
	}
	defer done()
	st, err := readNFT(c, nv, SidecarTables(), false, b.cache)
	if err != nil {
		return err
	}
	if len(st) > 0 {
		d, err := sidecarDiff(rs, st)
		if err != nil || d.Empty() {
			return err
		}
	}
	tx := c.begin()
	for name := range st {
		tx.delTable(name)
	}
	for _, t := range rs.Tables {
		tx.addTable(t.Name)
		for _, ch := range t.Chains {
			tx.addChain(t.Name, ch)
		}
		for _, r := range t.Rules {
			tx.addRule(t.Name, r)
		}
	}
	return fmtTx(tx.commit())
}

// VerifySidecar reports how the namespace's istio-proxy-* tables differ
// from o's.
func (b *Backend) VerifySidecar(ctx context.Context, o rules.SidecarOptions, v rules.View) (rules.Drift, error) {
	if err := ctx.Err(); err != nil {
		return rules.Drift{}, err
	}
	rs, err := b.sidecarRules(o)
	if err != nil {
		return rules.Drift{}, err
	}
	nv := view(v)
	c, done, err := b.open(nv)
	if err != nil {
		return rules.Drift{}, err
	}
	defer done()
	st, err := readNFT(c, nv, SidecarTables(), false, b.cache)
	if err != nil {
		return rules.Drift{}, err
	}
	return sidecarDiff(rs, st)
}

// DeleteSidecar deletes the istio-proxy-* tables that exist, in one
// transaction.
func (b *Backend) DeleteSidecar(ctx context.Context, _ *rules.SidecarOptions, v rules.View) error {
	return b.deleteTables(ctx, v, SidecarTables())
}

// HoldsSidecar reports whether an istio-proxy-* table exists.
func (b *Backend) HoldsSidecar(_ context.Context, v rules.View) (bool, error) {
	return b.holdsTables(v, SidecarTables())
}
