package xtables

import (
	"fmt"
	"slices"
	"strings"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Sidecar mode: the chains Istio's node agent programs for a pod with an
// injected istio-proxy (istio-cni's sidecar mode). Istio's names and rule
// text, so a pod Istio's agent set up verifies clean and one we set up
// passes Istio's istio-validation. Unlike the ambient set, some of these
// rules live in the built-in chains themselves (interface exclusions, the
// TPROXY marks): those are ours by their exact text.
const (
	ChainSidecarInbound    = "ISTIO_INBOUND"
	ChainSidecarRedirect   = "ISTIO_REDIRECT"
	ChainSidecarInRedirect = "ISTIO_IN_REDIRECT"
	ChainSidecarOutput     = "ISTIO_OUTPUT"
	ChainSidecarOutputDNS  = "ISTIO_OUTPUT_DNS"
	ChainSidecarDivert     = "ISTIO_DIVERT"
	ChainSidecarTProxy     = "ISTIO_TPROXY"
	ChainSidecarDrop       = "ISTIO_DROP"
)

// sidecarChains are every chain the sidecar rules may own, per table: what
// verify and delete look for whatever the options.
var sidecarChains = map[string][]string{
	"nat":    {ChainSidecarInbound, ChainSidecarRedirect, ChainSidecarInRedirect, ChainSidecarOutput, ChainSidecarOutputDNS},
	"mangle": {ChainSidecarDivert, ChainSidecarTProxy, ChainSidecarInbound, ChainSidecarDrop},
	"raw":    {ChainSidecarOutputDNS, ChainSidecarInbound},
}

var sidecarTables = []string{"mangle", "nat", "raw"}

func builtin(chain string) bool {
	switch chain {
	case "PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING":
		return true
	}
	return false
}

// SidecarRuleSet is a pod's sidecar rules for one or two address families:
// per family, every rule (ours in our chains, ours in built-in chains) in
// the order the kernel holds them, and our chains per table. Data: render
// it, compare it, apply it.
type SidecarRuleSet struct {
	V4, V6 *SidecarFamily // V6 nil when the pod's IPv6 is not captured
}

// SidecarFamily is one family's sidecar rules.
type SidecarFamily struct {
	// Chains are our chains per table, in creation order.
	Chains map[string][]string
	// Rules are in kernel order within each chain.
	Rules []Rule
}

// Families returns the families the set has rules for.
func (rs SidecarRuleSet) Families() []rules.Family { return rules.Families(rs.V6 != nil) }

// Family returns one family's rules (nil when absent).
func (rs SidecarRuleSet) Family(f rules.Family) *SidecarFamily {
	if f == rules.IPv6 {
		return rs.V6
	}
	return rs.V4
}

// Tables returns the tables the family has rules in, in rendering order.
func (sf *SidecarFamily) Tables() []string {
	var out []string
	for _, t := range sidecarTables {
		if len(sf.Chains[t]) > 0 || slices.ContainsFunc(sf.Rules, func(r Rule) bool { return r.Table == t }) {
			out = append(out, t)
		}
	}
	return out
}

// ChainRules returns the rule args of one chain, in order.
func (sf *SidecarFamily) ChainRules(table, chain string) []string {
	var out []string
	for _, r := range sf.Rules {
		if r.Table == table && r.Chain == chain {
			out = append(out, strings.Join(r.Args, " "))
		}
	}
	return out
}

// builtinChains returns the built-in chains of table the family has rules
// in, in first-use order.
func (sf *SidecarFamily) builtinChains(table string) []string {
	var out []string
	for _, r := range sf.Rules {
		if r.Table == table && builtin(r.Chain) && !slices.Contains(out, r.Chain) {
			out = append(out, r.Chain)
		}
	}
	return out
}

// RenderApply returns the iptables-restore --noflush batch that installs
// one family's rules into a namespace holding none of our sidecar chains:
// our chains are created with -N, so on a namespace that has them the batch
// fails as a whole and the backend repairs from the state instead.
func (rs SidecarRuleSet) RenderApply(f rules.Family) string {
	sf := rs.Family(f)
	var b strings.Builder
	for _, t := range sf.Tables() {
		fmt.Fprintf(&b, "*%s\n", t)
		for _, c := range sf.Chains[t] {
			fmt.Fprintf(&b, "-N %s\n", c)
		}
		for _, r := range sf.Rules {
			if r.Table == t {
				b.WriteString(r.Spec() + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// staleChains returns the sidecar chains of table present in ts that are
// not among ours. The ambient rules' ISTIO_OUTPUT (a chain name of both
// modes) is not a sidecar chain: it is the ambient set's when that set's
// ISTIO_PRERT exists beside it.
func staleChains(table string, ts *tableState, ours []string) []string {
	var out []string
	for _, c := range sidecarChains[table] {
		if ts.chains[c] && !slices.Contains(ours, c) && !ambientChain(c, ts) {
			out = append(out, c)
		}
	}
	return out
}

func ambientChain(c string, ts *tableState) bool {
	return c == ChainOutput && ts.chains[ChainPrerouting]
}

// foreignJump reports whether a rule jumping to target is one of ours to
// remove: a jump into a sidecar chain that is not wanted.
func foreignJump(table, target string, ts *tableState, ours []string) bool {
	return slices.Contains(sidecarChains[table], target) && !slices.Contains(ours, target) && !ambientChain(target, ts)
}

// diff compares one family's wanted rules (nil: none wanted) with a saved
// state: our chains with their rules in order, our built-in chain rules
// each once and in order among themselves (others' rules around them are
// left alone), and no other sidecar chain or jump into one.
func (sf *SidecarFamily) diff(f rules.Family, st saveState) rules.Drift {
	var d rules.Drift
	want := sf.orEmpty()
	for _, t := range sidecarTables {
		ts := st.table(t)
		prefix := fmt.Sprintf("%s -t %s ", f, t)
		ours := want.Chains[t]
		for _, c := range ours {
			if !ts.chains[c] {
				d.Missing = append(d.Missing, prefix+"-N "+c)
			}
			w, have := want.ChainRules(t, c), ts.rules[c]
			m, u := rules.MultisetDiff(w, have)
			for _, a := range m {
				d.Missing = append(d.Missing, prefix+"-A "+c+" "+a)
			}
			for _, a := range u {
				d.Unexpected = append(d.Unexpected, prefix+"-A "+c+" "+a)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(w, have) {
				d.Unexpected = append(d.Unexpected, prefix+c+": rules out of order")
			}
		}
		for _, c := range staleChains(t, ts, ours) {
			d.Unexpected = append(d.Unexpected, prefix+"-N "+c)
		}
		builtins := want.builtinChains(t)
		for _, chain := range ts.order {
			if builtin(chain) && !slices.Contains(builtins, chain) {
				builtins = append(builtins, chain)
			}
		}
		for _, chain := range builtins {
			w := want.ChainRules(t, chain)
			var have []string // ours among the chain's rules, in order
			for _, args := range ts.rules[chain] {
				target, jumps := JumpTarget(args)
				if slices.Contains(w, args) || jumps && foreignJump(t, target, ts, ours) {
					have = append(have, args)
				}
			}
			m, u := rules.MultisetDiff(w, have)
			for _, a := range m {
				d.Missing = append(d.Missing, prefix+"-A "+chain+" "+a)
			}
			for _, a := range u {
				d.Unexpected = append(d.Unexpected, prefix+"-A "+chain+" "+a)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(w, have) {
				d.Unexpected = append(d.Unexpected, prefix+chain+": our rules out of order")
			}
		}
	}
	return d
}

func (sf *SidecarFamily) orEmpty() *SidecarFamily {
	if sf == nil {
		return &SidecarFamily{Chains: map[string][]string{}}
	}
	return sf
}

// renderConverge returns a batch that turns the saved state of one family
// into exactly the wanted rules (nil: none), or "" when it already is.
// Our chains are declared with ":chain -" (under --noflush: created if
// missing, flushed if present) and refilled; every rule of ours in a
// built-in chain (wanted, or of the options old was built from) and any
// jump into an unwanted sidecar chain is deleted and the wanted ones
// appended; sidecar chains not wanted are flushed and deleted. One restore:
// the kernel commits each table at once.
func (sf *SidecarFamily) renderConverge(f rules.Family, st saveState, old *SidecarFamily) string {
	want := sf.orEmpty()
	dirty := !want.diff(f, st).Empty()
	var b strings.Builder
	for _, t := range sidecarTables {
		ts := st.table(t)
		ours := want.Chains[t]
		stale := staleChains(t, ts, ours)
		var drop []string // "CHAIN args" of ours in built-in chains
		for _, set := range []*SidecarFamily{old, want} {
			if set == nil {
				continue
			}
			for _, r := range set.Rules {
				if r.Table == t && builtin(r.Chain) {
					drop = append(drop, r.Chain+" "+strings.Join(r.Args, " "))
				}
			}
		}
		var dels []string
		for _, chain := range ts.order {
			for _, args := range ts.rules[chain] {
				target, jumps := JumpTarget(args)
				switch {
				case builtin(chain) && slices.Contains(drop, chain+" "+args),
					builtin(chain) && jumps && foreignJump(t, target, ts, ours),
					!builtin(chain) && !slices.Contains(sidecarChains[t], chain) && jumps && slices.Contains(stale, target):
					dels = append(dels, "-D "+chain+" "+args)
					if !slices.Contains(want.ChainRules(t, chain), args) {
						dirty = true // an old rule of ours still there
					}
				}
			}
		}
		var body strings.Builder
		for _, c := range ours {
			fmt.Fprintf(&body, ":%s - [0:0]\n", c)
		}
		for _, d := range dels {
			body.WriteString(d + "\n")
		}
		for _, c := range stale {
			fmt.Fprintf(&body, "-F %s\n", c)
		}
		for _, c := range stale {
			fmt.Fprintf(&body, "-X %s\n", c)
		}
		for _, r := range want.Rules {
			if r.Table == t {
				body.WriteString(r.Spec() + "\n")
			}
		}
		if body.Len() > 0 {
			fmt.Fprintf(&b, "*%s\n%sCOMMIT\n", t, body.String())
		}
	}
	if !dirty {
		return ""
	}
	return b.String()
}
