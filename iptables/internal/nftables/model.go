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
	// anon is the anonymous set a lookup of this statement names (a rule
	// gives it its id).
	anon anonSet
}

// Rule is one rule of a chain.
type Rule struct {
	Chain string
	stmts []statement
	// anon are the anonymous sets the rule's lookups name (created with
	// the rule, in the same transaction).
	anon []anonSet
	key  string // the expressions' encoding as compared, filled by prepare
	enc  []byte // the expressions' encoding as sent, filled by prepare
}

// anonSet is an anonymous constant set of one rule (`tcp dport != { 53,
// 15008 }`): id names it within a transaction.
type anonSet struct {
	id    uint32
	keyed nftSetType
	elems [][]byte
}

// nftSetType is a set's key type: nft's magic number and key length.
type nftSetType struct{ magic, len uint32 }

// Text is the rule as `nft list` prints it (counters at zero). A statement
// nft does not print (a protocol match implied by a later port match) has
// no text.
func (r Rule) Text() string {
	parts := make([]string, 0, len(r.stmts))
	for _, s := range r.stmts {
		if s.text != "" {
			parts = append(parts, s.text)
		}
	}
	return strings.Join(parts, " ")
}

// keyOf is the rule's key (see exprKey), its anonymous sets keyed by
// their elements.
func (r Rule) keyOf() (string, error) {
	return exprKeyAnon(r.exprs(), func(l *expr.Lookup) ([][]byte, bool) {
		for _, a := range r.anon {
			if a.id == l.SetID {
				return a.elems, true
			}
		}
		return nil, false
	})
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
