package nftables

import (
	"slices"

	nft "github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// Sidecar mode in native nftables: Istio's istio-proxy-* inet tables (the
// layout of istio-cni's native-nftables mode), so a pod Istio's agent set up
// verifies clean and one we set up is what Istio would have written.
const (
	TableSidecarNat    = "istio-proxy-nat"
	TableSidecarMangle = "istio-proxy-mangle"
	TableSidecarRaw    = "istio-proxy-raw"

	chainInbound    = "istio-inbound"
	chainRedirect   = "istio-redirect"
	chainInRedirect = "istio-in-redirect"
	chainOutput     = "istio-output"
	chainOutputDNS  = "istio-output-dns"
	chainDivert     = "istio-divert"
	chainTProxy     = "istio-tproxy"
	chainDrop       = "istio-drop"
)

// SidecarTables are the tables of the sidecar rules (each exists only
// when it has rules).
func SidecarTables() []string { return []string{TableSidecarNat, TableSidecarMangle, TableSidecarRaw} }

// sidecarLayout is each table's chains in creation order (base chains
// first, as Istio creates them); a chain is created only when it has rules.
var sidecarLayout = map[string][]Chain{
	TableSidecarNat: {
		baseChain(BasePrerouting, nft.ChainTypeNAT, nft.ChainHookPrerouting, nftPriorityDstNAT),
		baseChain(BaseOutput, nft.ChainTypeNAT, nft.ChainHookOutput, nftPriorityDstNAT),
		{Name: chainInbound}, {Name: chainRedirect}, {Name: chainInRedirect}, {Name: chainOutput}, {Name: chainOutputDNS},
	},
	TableSidecarMangle: {
		baseChain(BasePrerouting, nft.ChainTypeFilter, nft.ChainHookPrerouting, nftPriorityMangle),
		baseChain(BaseOutput, nft.ChainTypeRoute, nft.ChainHookOutput, nftPriorityMangle),
		{Name: chainDivert}, {Name: chainTProxy}, {Name: chainInbound}, {Name: chainDrop},
	},
	TableSidecarRaw: {
		baseChain(BasePrerouting, nft.ChainTypeFilter, nft.ChainHookPrerouting, nftPriorityRaw),
		baseChain(BaseOutput, nft.ChainTypeFilter, nft.ChainHookOutput, nftPriorityRaw),
		{Name: chainInbound}, {Name: chainOutputDNS},
	},
}

// nftList builds the rules of the sidecar tables the way Istio's nft
// builder orders them: appended, or inserted before a 0-based index (an
// index at or past the end, or into an empty chain, appends).
type nftList struct {
	rules map[string][]Rule // table -> rules in order of their chains
	anon  uint32            // last anonymous set id
}

func (l *nftList) chainRules(table, chain string) []int {
	var idx []int
	for i, r := range l.rules[table] {
		if r.Chain == chain {
			idx = append(idx, i)
		}
	}
	return idx
}

func (l *nftList) add(table, chain string, s ...statement) {
	l.rules[table] = append(l.rules[table], l.rule(chain, s))
}

func (l *nftList) insert(table, chain string, index int, s ...statement) {
	idx := l.chainRules(table, chain)
	if len(idx) == 0 || index >= len(idx) {
		l.add(table, chain, s...)
		return
	}
	l.rules[table] = slices.Insert(l.rules[table], idx[index], l.rule(chain, s))
}

// rule makes a rule, giving its anonymous sets ids unique in the rule set
// (so in any transaction it is written in).
func (l *nftList) rule(chain string, s []statement) Rule {
	r := Rule{Chain: chain, stmts: s}
	for i := range r.stmts {
		for j, e := range r.stmts[i].exprs {
			lk, ok := e.(*expr.Lookup)
			if !ok || lk.SetName != anonSetName {
				continue
			}
			l.anon++
			lk2 := *lk
			lk2.SetID = l.anon
			exprs := slices.Clone(r.stmts[i].exprs)
			exprs[j] = &lk2
			r.stmts[i].exprs = exprs
			a := r.stmts[i].anon
			a.id = l.anon
			r.anon = append(r.anon, a)
		}
	}
	return r
}

func (l *nftList) ruleSet() RuleSet {
	var rs RuleSet
	for _, name := range SidecarTables() {
		rules := l.rules[name]
		if len(rules) == 0 {
			continue
		}
		t := Table{Name: name}
		for _, c := range sidecarLayout[name] {
			if slices.ContainsFunc(rules, func(r Rule) bool { return r.Chain == c.Name }) {
				t.Chains = append(t.Chains, c)
			}
		}
		// Rules grouped by chain, in chain order (the kernel keeps one
		// list per chain; the order among chains is immaterial).
		for _, c := range t.Chains {
			for _, r := range rules {
				if r.Chain == c.Name {
					t.Rules = append(t.Rules, r)
				}
			}
		}
		rs.Tables = append(rs.Tables, t)
	}
	return rs
}
