package xtables

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Our chains: ChainPrerouting and ChainOutput in mangle, nat and raw inside
// the pod; ChainPostrouting in the node's nat table. Istio's names, so pods
// and nodes its agent set up are recognised and adopted.
const (
	ChainPrerouting  = "ISTIO_PRERT"
	ChainOutput      = "ISTIO_OUTPUT"
	ChainPostrouting = "ISTIO_POSTRT"
)

// localhost is the family's loopback address as iptables prints it.
func localhost(f rules.Family) string {
	if f == rules.IPv6 {
		return "::1/128"
	}
	return "127.0.0.1/32"
}

func hostPrefix(a netip.Addr) string {
	return netip.PrefixFrom(a, a.BitLen()).String()
}

// Rule is one rule appended to one of our chains. Args are in the canonical
// order iptables-save prints them, so a rule read back compares equal as text.
type Rule struct {
	Table string
	Chain string
	Args  []string
}

// Spec is the rule as iptables-save prints it, without the table.
func (r Rule) Spec() string {
	return "-A " + r.Chain + " " + strings.Join(r.Args, " ")
}

// Jump is a rule in a built-in chain that enters one of our chains.
type Jump struct {
	Table string
	From  string // built-in chain
	To    string // our chain
	// First: the jump must be the first rule of From (inserted at position
	// 1), so no earlier terminal rule of someone else pre-empts ours.
	First bool
}

func (j Jump) rule() Rule {
	return Rule{Table: j.Table, Chain: j.From, Args: []string{"-j", j.To}}
}

// spec is the jump as a restore line: appended, or inserted at 1.
func (j Jump) spec() string {
	if j.First {
		return "-I " + j.From + " 1 -j " + j.To
	}
	return j.rule().Spec()
}

// isJump reports whether rs has a plain jump from chain to target.
func (rs RuleSet) isJump(table, chain, target string) (Jump, bool) {
	for _, j := range rs.Jumps {
		if j.Table == table && j.From == chain && j.To == target {
			return j, true
		}
	}
	return Jump{}, false
}

// RuleSet is a complete set of our chains and rules for one or two address
// families. It is data: render it, compare it, apply it.
type RuleSet struct {
	// Tables lists the tables we own chains in, in rendering order.
	Tables []string
	// Jumps are the entries from built-in chains into ours. Every chain we
	// own is the target of exactly one jump.
	Jumps []Jump
	// V4 and V6 are the rules of our chains, in order. V6 is nil when IPv6
	// is off.
	V4, V6 []Rule
}

// Families returns the address families the set has rules for.
func (rs RuleSet) Families() []rules.Family {
	return rules.Families(rs.V6 != nil)
}

// Rules returns the rules of one family.
func (rs RuleSet) Rules(f rules.Family) []Rule {
	if f == rules.IPv6 {
		return rs.V6
	}
	return rs.V4
}

// Chains returns our chains of one table, in jump order.
func (rs RuleSet) Chains(table string) []string {
	var out []string
	for _, j := range rs.Jumps {
		if j.Table == table {
			out = append(out, j.To)
		}
	}
	return out
}

// podTables are the tables the in-pod rules own chains in. All three are
// always present, even when a chain stays empty (raw without DNS capture), so
// delete never needs to know the options the pod was enrolled with.
var podTables = []string{"mangle", "nat", "raw"}

// BuildPodRules returns the in-pod rule set for the given node and pod
// options. It touches nothing.
func BuildPodRules(n rules.Node, opts rules.PodOptions) RuleSet {
	rs := RuleSet{Tables: podTables}
	for _, t := range podTables {
		rs.Jumps = append(rs.Jumps,
			Jump{Table: t, From: "PREROUTING", To: ChainPrerouting},
			Jump{Table: t, From: "OUTPUT", To: ChainOutput})
	}
	rs.V4 = podRules(rules.IPv4, n, opts)
	if n.IPv6 {
		rs.V6 = podRules(rules.IPv6, n, opts)
	}
	return rs
}

func podRules(f rules.Family, n rules.Node, opts rules.PodOptions) []Rule {
	var (
		mark     = hex(rules.ProxyMark) + "/" + hex(rules.MarkMask)
		connmark = hex(rules.ConnMark) + "/" + hex(rules.MarkMask)
		lo       = localhost(f)
		probe    = hostPrefix(f.ProbeSNAT())
		out      []Rule
	)
	add := func(table, chain string, args ...string) {
		out = append(out, Rule{Table: table, Chain: chain, Args: args})
	}

	// mangle: connections ztunnel accepted (its packets carry 0x539) get the
	// connmark; packets of those connections leaving the pod get it back as
	// mark so the policy route (table 100) delivers ztunnel's spoofed-source
	// replies locally.
	add("mangle", ChainPrerouting, "-m", "mark", "--mark", mark, "-j", "CONNMARK", "--set-xmark", connmark)
	add("mangle", ChainOutput, "-m", "connmark", "--mark", connmark, "-j", "CONNMARK", "--restore-mark", "--nfmask", "0xffffffff", "--ctmask", "0xffffffff")

	// nat PREROUTING: traffic arriving at the pod.
	for _, iface := range rules.RerouteInterfaces(n, opts) {
		add("nat", ChainPrerouting, "-i", iface, "-p", "tcp", "-j", "REDIRECT", "--to-ports", strconv.Itoa(rules.OutboundPort))
	}
	if !opts.BypassInbound {
		// Kubelet probes arrive SNATed to the probe address: not captured.
		add("nat", ChainPrerouting, "-s", probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
		add("nat", ChainPrerouting, "!", "-d", lo, "-p", "tcp", "-m", "tcp", "!", "--dport", strconv.Itoa(rules.HBONEPort),
			"-m", "mark", "!", "--mark", mark, "-j", "REDIRECT", "--to-ports", strconv.Itoa(rules.InboundPort))
	}

	// nat OUTPUT: traffic the pod sends.
	add("nat", ChainOutput, "-d", probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
	if opts.DNSCapture {
		add("nat", ChainOutput, "!", "-o", "lo", "-p", "udp", "-m", "mark", "!", "--mark", mark,
			"-m", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", strconv.Itoa(rules.DNSPort))
		add("nat", ChainOutput, "!", "-d", lo, "-p", "tcp", "-m", "tcp", "--dport", "53",
			"-m", "mark", "!", "--mark", mark, "-j", "REDIRECT", "--to-ports", strconv.Itoa(rules.DNSPort))
	}
	add("nat", ChainOutput, "-p", "tcp", "-m", "mark", "--mark", connmark, "-j", "ACCEPT")
	add("nat", ChainOutput, "!", "-d", lo, "-o", "lo", "-j", "ACCEPT")
	add("nat", ChainOutput, "!", "-d", lo, "-p", "tcp", "-m", "mark", "!", "--mark", mark,
		"-j", "REDIRECT", "--to-ports", strconv.Itoa(rules.OutboundPort))

	// raw: ztunnel's own DNS upstream traffic and its replies go to conntrack
	// zone 1, so they never collide with the pod's redirected DNS flows.
	if opts.DNSCapture {
		add("raw", ChainPrerouting, "-p", "udp", "-m", "mark", "!", "--mark", mark,
			"-m", "udp", "--sport", "53", "-j", "CT", "--zone", "1")
		add("raw", ChainOutput, "-p", "udp", "-m", "mark", "--mark", mark,
			"-m", "udp", "--dport", "53", "-j", "CT", "--zone", "1")
	}
	return out
}

// BuildHostRules returns the node's probe SNAT rule set: node-originated TCP
// (a local socket exists) to a pod IP in the probe ipset leaves with the probe
// source address, which the in-pod rules accept uncaptured.
func BuildHostRules(n rules.Node) RuleSet {
	rs := RuleSet{
		Tables: []string{"nat"},
		Jumps:  []Jump{{Table: "nat", From: "POSTROUTING", To: ChainPostrouting, First: true}},
	}
	rs.V4 = hostRules(rules.IPv4)
	if n.IPv6 {
		rs.V6 = hostRules(rules.IPv6)
	}
	return rs
}

func hostRules(f rules.Family) []Rule {
	return []Rule{{Table: "nat", Chain: ChainPostrouting, Args: []string{
		"-p", "tcp", "-m", "owner", "--socket-exists", "-m", "set", "--match-set", f.ProbeSet(), "dst",
		"-j", "SNAT", "--to-source", f.ProbeSNAT().String()}}}
}

func hex(v int) string { return "0x" + strconv.FormatInt(int64(v), 16) }
