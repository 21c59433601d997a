package nftables

import (
	"fmt"
	"slices"

	nft "github.com/google/nftables"

	"github.com/ambientd/ambientd/iptables/rules"
)

// converge makes the tables of rs exactly rs in one transaction, unless they
// already are (then nothing is written). Existing tables of ours are kept
// with their sets (and set elements); their chains are flushed and deleted
// and ours recreated, all inside the one atomic commit, so packets see the
// old rules or the new ones, never none.
func (b *Backend) converge(c *nft.Conn, v *View, rs RuleSet) (bool, error) {
	st, err := readNFT(c, v, rs.TableNames(), rs.hasSets(), b.cache, b.closing)
	if err != nil {
		return false, err
	}
	if len(st) > 0 {
		d, err := rs.diff(st)
		if err != nil || d.Empty() {
			return false, err
		}
	}
	for _, t := range rs.Tables {
		table := c.AddTable(&nft.Table{Name: t.Name, Family: inet})
		ts := st[t.Name]
		if ts != nil {
			for _, ch := range ts.chains {
				c.FlushChain(ch)
			}
			for _, ch := range ts.chains {
				c.DelChain(ch)
			}
		}
		for _, s := range t.Sets {
			if ts != nil && slices.Contains(ts.sets, s.Name) {
				continue
			}
			set := probeNFTSet(table, s.V6)
			if err := c.AddSet(set, nil); err != nil {
				return false, fmt.Errorf("set %s: %w", s.Name, err)
			}
		}
		chains := map[string]*nft.Chain{}
		for _, ch := range t.Chains {
			nc := &nft.Chain{Name: ch.Name, Table: table}
			if ch.base() {
				prio := nft.ChainPriority(ch.Priority)
				policy := nft.ChainPolicyAccept
				nc.Type, nc.Hooknum, nc.Priority, nc.Policy = ch.Type, ch.Hook, &prio, &policy
			}
			chains[ch.Name] = c.AddChain(nc)
		}
		for _, r := range t.Rules {
			c.AddRule(&nft.Rule{Table: table, Chain: chains[r.Chain], Exprs: r.exprs()})
		}
	}
	if err := c.Flush(); err != nil {
		return false, fmt.Errorf("nftables transaction: %w", err)
	}
	return true, nil
}

func probeNFTSet(table *nft.Table, v6 bool) *nft.Set {
	s := &nft.Set{Table: table, Name: rules.ProbeSetV4, KeyType: nft.TypeIPAddr, Comment: probeSetComment}
	if v6 {
		s.Name, s.KeyType = rules.ProbeSetV6, nft.TypeIP6Addr
	}
	return s
}

// remove deletes the named tables that exist (as listed on c, or seen in
// v), in one transaction.
func (b *Backend) remove(c *nft.Conn, v *View, names []string) error {
	var tables []*nft.Table
	if v != nil {
		tables = v.tables(names)
	} else {
		all, err := c.ListTablesOfFamily(inet)
		if err != nil {
			return fmt.Errorf("listing inet tables: %w", err)
		}
		for _, t := range all {
			if slices.Contains(names, t.Name) {
				tables = append(tables, t)
			}
		}
	}
	if len(tables) == 0 {
		return nil
	}
	for _, t := range tables {
		c.DelTable(t)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables transaction: %w", err)
	}
	return nil
}
