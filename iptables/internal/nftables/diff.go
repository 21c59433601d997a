package nftables

import (
	"fmt"
	"slices"

	nft "github.com/google/nftables"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

func sameBase(have chainInfo, want Chain) bool {
	if !want.base() {
		return have.hook == nil
	}
	return have.hook != nil && *have.hook == uint32(*want.Hook) && nft.ChainType(have.typ) == want.Type &&
		have.prio == want.Priority
}

// diff compares the wanted set with what was read: tables, sets (by name),
// chains (with their hooks), and each chain's rules in order.
func (rs RuleSet) diff(st map[string]*tableState) (rules.Drift, error) {
	var d rules.Drift
	for _, t := range rs.Tables {
		prefix := "nft inet " + t.Name
		ts := st[t.Name]
		if ts == nil {
			d.Missing = append(d.Missing, "nft add table inet "+t.Name)
			ts = &tableState{rules: map[string][]ruleRead{}}
		}
		for _, s := range t.Sets {
			if !slices.Contains(ts.sets, s.Name) {
				d.Missing = append(d.Missing, prefix+": set "+s.Name)
			}
		}
		have := map[string]chainInfo{}
		for _, ch := range ts.chains {
			have[ch.name] = ch
			if !slices.ContainsFunc(t.Chains, func(c Chain) bool { return c.Name == ch.name }) {
				d.Unexpected = append(d.Unexpected, prefix+": chain "+ch.name)
			}
		}
		for _, c := range t.Chains {
			hc, ok := have[c.Name]
			switch {
			case !ok:
				d.Missing = append(d.Missing, prefix+": chain "+c.Name)
			case !sameBase(hc, c):
				d.Unexpected = append(d.Unexpected, prefix+": chain "+c.Name+" has another type, hook or priority")
			}
			var want, got []string
			text := map[string]string{}
			for _, r := range t.Rules {
				if r.Chain != c.Name {
					continue
				}
				k := r.key
				if k == "" {
					var err error
					if k, err = r.keyOf(); err != nil {
						return d, err
					}
				}
				want = append(want, k)
				text[k] = r.Text()
			}
			handles := map[string][]uint64{}
			for _, r := range ts.rules[c.Name] {
				got = append(got, r.key)
				handles[r.key] = append(handles[r.key], r.handle)
			}
			m, u := rules.MultisetDiff(want, got)
			for _, k := range m {
				d.Missing = append(d.Missing, prefix+" "+c.Name+": "+text[k])
			}
			for _, k := range u {
				line := fmt.Sprintf("%s %s: rule handle %d", prefix, c.Name, handles[k][0])
				if t, ok := text[k]; ok {
					line += " (duplicate) " + t
				}
				handles[k] = handles[k][1:]
				d.Unexpected = append(d.Unexpected, line)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(want, got) {
				d.Unexpected = append(d.Unexpected, prefix+" "+c.Name+": rules out of order")
			}
		}
	}
	return d, nil
}
