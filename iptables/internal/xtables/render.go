package xtables

import (
	"fmt"
	"slices"
	"strings"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// RenderApply returns the iptables-restore --noflush batch that installs the
// set for one family into a namespace that holds none of our chains yet. It
// creates our chains with -N, so on a namespace that already has them the
// whole batch fails instead of duplicating jumps; the backend then reads the
// state and repairs it (see renderRepair).
func (rs RuleSet) RenderApply(f rules.Family) string {
	var b strings.Builder
	famRules := rs.Rules(f)
	for _, t := range rs.Tables {
		fmt.Fprintf(&b, "*%s\n", t)
		for _, c := range rs.Chains(t) {
			fmt.Fprintf(&b, "-N %s\n", c)
		}
		for _, r := range famRules {
			if r.Table == t {
				b.WriteString(r.Spec() + "\n")
			}
		}
		for _, j := range rs.Jumps {
			if j.Table == t {
				b.WriteString(j.spec() + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// RenderDelete returns the iptables-restore --noflush batch that removes the
// set's jumps and chains from a namespace that holds all of them exactly once.
// It fails as a whole when something is already gone; the backend then reads
// the state and removes what is left (see renderDeleteFrom).
func (rs RuleSet) RenderDelete(f rules.Family) string {
	var b strings.Builder
	for _, t := range rs.Tables {
		fmt.Fprintf(&b, "*%s\n", t)
		for _, j := range rs.Jumps {
			if j.Table == t {
				fmt.Fprintf(&b, "-D %s -j %s\n", j.From, j.To)
			}
		}
		for _, c := range rs.Chains(t) {
			fmt.Fprintf(&b, "-F %s\n", c)
		}
		for _, c := range rs.Chains(t) {
			fmt.Fprintf(&b, "-X %s\n", c)
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// renderRepair returns a batch that turns the current state into the wanted
// one, or "" when they already agree. Our chains are declared with ":chain -",
// which under --noflush creates a missing chain and flushes an existing one,
// then refilled; jumps are added when missing, and duplicates or foreign
// references to our chains removed, so the result has exactly one jump each.
func (rs RuleSet) renderRepair(f rules.Family, st saveState) string {
	if rs.diff(f, st).Empty() {
		return ""
	}
	var b strings.Builder
	famRules := rs.Rules(f)
	for _, t := range rs.Tables {
		ours := rs.Chains(t)
		fmt.Fprintf(&b, "*%s\n", t)
		for _, c := range ours {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
		for _, r := range famRules {
			if r.Table == t {
				b.WriteString(r.Spec() + "\n")
			}
		}
		ts := st.table(t)
		for _, chain := range ts.order {
			if slices.Contains(ours, chain) {
				continue
			}
			kept := map[string]bool{}
			for _, args := range ts.rules[chain] {
				target, ok := JumpTarget(args)
				if !ok || !slices.Contains(ours, target) {
					continue
				}
				// A jump that must come first is always deleted and
				// re-inserted at 1 (deleting by spec removes the first
				// match, so keeping one among duplicates cannot be aimed).
				j, isOurs := rs.isJump(t, chain, target)
				if isOurs && !j.First && args == "-j "+target && !kept[target] {
					kept[target] = true
					continue
				}
				fmt.Fprintf(&b, "-D %s %s\n", chain, args)
			}
		}
		for _, j := range rs.Jumps {
			if j.Table != t {
				continue
			}
			if j.First || !slices.Contains(ts.rules[j.From], "-j "+j.To) {
				b.WriteString(j.spec() + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// renderDeleteFrom returns a batch that removes everything of ours present
// in the state, or "" when nothing is left.
func (rs RuleSet) renderDeleteFrom(st saveState) string {
	var b strings.Builder
	for _, t := range rs.Tables {
		ts := st.table(t)
		var present []string
		for _, c := range rs.Chains(t) {
			if ts.chains[c] {
				present = append(present, c)
			}
		}
		if len(present) == 0 {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", t)
		for _, chain := range ts.order {
			if slices.Contains(present, chain) {
				continue
			}
			for _, args := range ts.rules[chain] {
				if target, ok := JumpTarget(args); ok && slices.Contains(present, target) {
					fmt.Fprintf(&b, "-D %s %s\n", chain, args)
				}
			}
		}
		for _, c := range present {
			fmt.Fprintf(&b, "-F %s\n", c)
		}
		for _, c := range present {
			fmt.Fprintf(&b, "-X %s\n", c)
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// JumpTarget returns the chain a rule jumps or goes to.
func JumpTarget(args string) (string, bool) {
	f := strings.Fields(args)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "-j" || f[i] == "-g" {
			return f[i+1], true
		}
	}
	return "", false
}
