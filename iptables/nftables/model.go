package nftables

import (
	"slices"
	"strings"

	nft "github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// Native nftables layout, Istio's (1.28+) so pods and nodes it enrolled in
// nft mode are adopted: inet tables istio-ambient-{nat,mangle,raw}, base
// chains prerouting/output (postrouting on the node), regular chains
// istio-prerouting/istio-output, probe sets in the nat table.
const (
	TableNat    = "istio-ambient-nat"
	TableMangle = "istio-ambient-mangle"
	TableRaw    = "istio-ambient-raw"

	// ChainPrerouting and ChainOutput are the regular chains holding the
	// in-pod rules, jumped to from the base chains BasePrerouting and
	// BaseOutput; BasePostrouting holds the node's probe SNAT.
	ChainPrerouting = "istio-prerouting"
	ChainOutput     = "istio-output"
	BasePrerouting  = "prerouting"
	BaseOutput      = "output"
	BasePostrouting = "postrouting"

	probeSetComment     = "pod IPs whose kubelet probes are SNATed to the probe address"
	nftPriorityDstNAT   = -100
	nftPriorityMangle   = -150
	nftPriorityRaw      = -300
	nftPrioritySrcNAT   = 100
	nftPolicyAcceptText = "policy accept;"
)

// PodTables are the tables of the in-pod rules: all three always exist, so
// delete needs no options.
func PodTables() []string { return []string{TableNat, TableMangle, TableRaw} }

// statement is one statement of a rule: the text nft prints for it and the
// expressions that implement it. Both come from the same constructor, so the
// golden text and what is programmed cannot drift apart.
type statement struct {
	text  string
	exprs []expr.Any
}

// Rule is one rule of a chain.
type Rule struct {
	Chain string
	stmts []statement
	key   string // the expressions' encoding as compared, filled by prepare
	enc   []byte // the expressions' encoding as sent, filled by prepare
}

// Text is the rule as `nft list` prints it (counters at zero).
func (r Rule) Text() string {
	parts := make([]string, len(r.stmts))
	for i, s := range r.stmts {
		parts[i] = s.text
	}
	return strings.Join(parts, " ")
}

func (r Rule) exprs() []expr.Any {
	var out []expr.Any
	for _, s := range r.stmts {
		out = append(out, s.exprs...)
	}
	return out
}

// Chain is a chain; base chains have a hook.
type Chain struct {
	Name     string
	Type     nft.ChainType // "" for a regular chain
	Hook     *nft.ChainHook
	Priority int32
}

func (c Chain) base() bool { return c.Hook != nil }

// Set is a named set of addresses (the probe sets).
type Set struct {
	Name string
	V6   bool
}

// Table is one inet table: its sets, chains (in creation order) and rules
// (in order; a chain's rules are those naming it).
type Table struct {
	Name   string
	Sets   []Set
	Chains []Chain
	Rules  []Rule
}

// RuleSet is a complete set of our nftables tables. Like the iptables
// rule sets it is data: render it, compare it, apply it.
type RuleSet struct {
	Tables []Table
}

func (rs RuleSet) hasSets() bool {
	return slices.ContainsFunc(rs.Tables, func(t Table) bool { return len(t.Sets) > 0 })
}

// TableNames lists the set's tables.
func (rs RuleSet) TableNames() []string {
	out := make([]string, len(rs.Tables))
	for i, t := range rs.Tables {
		out[i] = t.Name
	}
	return out
}
