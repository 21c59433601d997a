package xtables

import (
	"bufio"
	"fmt"
	"slices"
	"strings"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// saveState is iptables-save output parsed into tables, chains and rules.
type saveState map[string]*tableState

type tableState struct {
	chains map[string]bool     // every declared chain
	order  []string            // chains in declaration order
	rules  map[string][]string // chain -> rule args as printed, in order
}

func (s saveState) table(name string) *tableState {
	if t, ok := s[name]; ok {
		return t
	}
	return &tableState{chains: map[string]bool{}, rules: map[string][]string{}}
}

// parseSave parses iptables-save text (without counters). Comment lines,
// including iptables-nft's warning about legacy tables, are ignored.
func parseSave(text string) (saveState, error) {
	st := saveState{}
	var cur *tableState
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			cur = &tableState{chains: map[string]bool{}, rules: map[string][]string{}}
			st[line[1:]] = cur
		case line == "COMMIT":
			cur = nil
		case cur == nil:
			return nil, fmt.Errorf("iptables-save line %d outside a table: %q", n, line)
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if !cur.chains[name] {
				cur.chains[name] = true
				cur.order = append(cur.order, name)
			}
		case strings.HasPrefix(line, "-A "):
			chain, args, _ := strings.Cut(line[3:], " ")
			cur.rules[chain] = append(cur.rules[chain], args)
		default:
			return nil, fmt.Errorf("iptables-save line %d not understood: %q", n, line)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading iptables-save output: %w", err)
	}
	return st, nil
}

// diff compares the wanted rules of one family with a saved state: our
// chains, their rules in order, and exactly one plain jump into each.
func (rs RuleSet) diff(f rules.Family, st saveState) rules.Drift {
	var d rules.Drift
	famRules := rs.Rules(f)
	for _, t := range rs.Tables {
		ts := st.table(t)
		prefix := fmt.Sprintf("%s -t %s ", f, t)
		ours := rs.Chains(t)
		for _, c := range ours {
			if !ts.chains[c] {
				d.Missing = append(d.Missing, prefix+"-N "+c)
			}
			var want []string
			for _, r := range famRules {
				if r.Table == t && r.Chain == c {
					want = append(want, strings.Join(r.Args, " "))
				}
			}
			have := ts.rules[c]
			m, u := rules.MultisetDiff(want, have)
			for _, a := range m {
				d.Missing = append(d.Missing, prefix+"-A "+c+" "+a)
			}
			for _, a := range u {
				d.Unexpected = append(d.Unexpected, prefix+"-A "+c+" "+a)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(want, have) {
				d.Unexpected = append(d.Unexpected, prefix+c+": rules out of order")
			}
		}
		// References into our chains from anywhere else.
		for _, chain := range ts.order {
			if slices.Contains(ours, chain) {
				continue
			}
			seen := map[string]bool{}
			for i, args := range ts.rules[chain] {
				target, ok := JumpTarget(args)
				if !ok || !slices.Contains(ours, target) {
					continue
				}
				j, isOurs := rs.isJump(t, chain, target)
				if isOurs && args == "-j "+target && !seen[target] && (!j.First || i == 0) {
					seen[target] = true
					continue
				}
				d.Unexpected = append(d.Unexpected, prefix+"-A "+chain+" "+args)
			}
		}
		for _, j := range rs.Jumps {
			if j.Table != t {
				continue
			}
			from := ts.rules[j.From]
			if j.First && (len(from) == 0 || from[0] != "-j "+j.To) || !slices.Contains(from, "-j "+j.To) {
				d.Missing = append(d.Missing, prefix+j.spec())
			}
		}
	}
	return d
}
