package nftables

import (
	"fmt"
	"strconv"
	"strings"

	nft "github.com/google/nftables"
)

var hookNames = map[nft.ChainHook]string{
	*nft.ChainHookPrerouting:  "prerouting",
	*nft.ChainHookOutput:      "output",
	*nft.ChainHookPostrouting: "postrouting",
}

// priorityText prints a base chain's priority the way nft does for the
// standard values of its family and type.
func priorityText(c Chain) string {
	names := map[int32]string{nftPriorityRaw: "raw", nftPriorityMangle: "mangle", 0: "filter"}
	switch *c.Hook {
	case *nft.ChainHookPrerouting:
		names[nftPriorityDstNAT] = "dstnat"
	case *nft.ChainHookPostrouting:
		names[nftPrioritySrcNAT] = "srcnat"
	}
	if n, ok := names[c.Priority]; ok {
		return n
	}
	return strconv.Itoa(int(c.Priority))
}

// Render returns the set as `nft list table` prints it (one table after
// another, counters at zero, sets without elements).
func (rs RuleSet) Render() string {
	var b strings.Builder
	for _, t := range rs.Tables {
		b.WriteString(t.render())
	}
	return b.String()
}

func (t Table) render() string {
	var b strings.Builder
	fmt.Fprintf(&b, "table inet %s {\n", t.Name)
	for i, s := range t.Sets {
		typ := "ipv4_addr"
		if s.V6 {
			typ = "ipv6_addr"
		}
		fmt.Fprintf(&b, "\tset %s {\n\t\ttype %s\n\t\tcomment %q\n\t}\n", s.Name, typ, probeSetComment)
		if i < len(t.Sets)-1 || len(t.Chains) > 0 {
			b.WriteString("\n")
		}
	}
	for i, c := range t.Chains {
		fmt.Fprintf(&b, "\tchain %s {\n", c.Name)
		if c.base() {
			fmt.Fprintf(&b, "\t\ttype %s hook %s priority %s; %s\n", c.Type, hookNames[*c.Hook], priorityText(c), nftPolicyAcceptText)
		}
		for _, r := range t.Rules {
			if r.Chain == c.Name {
				fmt.Fprintf(&b, "\t\t%s\n", r.Text())
			}
		}
		b.WriteString("\t}\n")
		if i < len(t.Chains)-1 {
			b.WriteString("\n")
		}
	}
	b.WriteString("}\n")
	return b.String()
}
