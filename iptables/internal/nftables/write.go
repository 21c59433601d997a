package nftables

import (
	"fmt"
	"slices"
)

// converge makes the tables of rs exactly rs in one transaction on c, unless
// they already are (then nothing is written). Existing tables of ours are
// kept with their sets (and set elements); their chains are flushed and
// deleted and ours recreated, all inside the one atomic commit, so packets
// see the old rules or the new ones, never none.
func (b *Backend) converge(c *conn, v *View, rs RuleSet) (bool, error) {
	st, err := readNFT(c, v, rs.TableNames(), rs.hasSets(), b.cache)
	if err != nil {
		return false, err
	}
	if len(st) > 0 {
		d, err := rs.diff(st)
		if err != nil || d.Empty() {
			return false, err
		}
	}
	tx := c.begin()
	for _, t := range rs.Tables {
		tx.addTable(t.Name)
		ts := st[t.Name]
		if ts != nil {
			for _, ch := range ts.chains {
				tx.flushChain(t.Name, ch.name)
			}
			for _, ch := range ts.chains {
				tx.delChain(t.Name, ch.name)
			}
		}
		for i, s := range t.Sets {
			if ts != nil && slices.Contains(ts.sets, s.Name) {
				continue
			}
			tx.addSet(t.Name, s, uint32(i+1))
		}
		for _, ch := range t.Chains {
			tx.addChain(t.Name, ch)
		}
		for _, r := range t.Rules {
			tx.addRule(t.Name, r)
		}
	}
	if err := tx.commit(); err != nil {
		return false, fmtTx(err)
	}
	return true, nil
}

// remove deletes the named tables that exist (as seen in v, or listed on
// c), in one transaction.
func (b *Backend) remove(c *conn, v *View, names []string) error {
	var tables []string
	if v != nil {
		tables = v.tables(names)
	} else {
		all, err := c.listTables()
		if err != nil {
			return err
		}
		for _, t := range all {
			if slices.Contains(names, t) {
				tables = append(tables, t)
			}
		}
	}
	if len(tables) == 0 {
		return nil
	}
	tx := c.begin()
	for _, t := range tables {
		tx.delTable(t)
	}
	return fmtTx(tx.commit())
}

func fmtTx(err error) error {
	if err != nil {
		return fmt.Errorf("nftables transaction: %w", err)
	}
	return nil
}
