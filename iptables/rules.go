// Package iptables programs the in-pod redirection rules of an ambient-mesh pod
// and the node's probe SNAT rule. Rule sets are plain data (BuildPodRules,
// BuildHostRules) rendered to iptables-restore text; a Manager applies,
// verifies and deletes them with one iptables-restore batch per address family
// and sets the pod's policy route and the node's probe ipsets over netlink.
//
// Chain, ipset, mark and address values are the ones Istio's node agent uses,
// so pods and nodes it set up are recognised and can be adopted.
package iptables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Marks, ports, addresses and names of the in-pod rules (see DESIGN.md).
const (
	// ProxyMark is set by ztunnel on all its sockets.
	ProxyMark = 0x539
	// ConnMark tags connections ztunnel created (via mangle CONNMARK) so
	// their return traffic is routed to the local stack by table RouteTable.
	ConnMark = 0x111
	// MarkMask is the part of the mark the rules own.
	MarkMask = 0xfff
	// RouteTable is the policy routing table holding the local catch-all.
	RouteTable = 100
	// RulePriority is the priority of the fwmark rule (Istio uses the same).
	RulePriority = 32764

	OutboundPort = 15001
	InboundPort  = 15006
	HBONEPort    = 15008
	DNSPort      = 15053

	// ChainPrerouting and ChainOutput are our chains in mangle, nat and raw
	// inside the pod; ChainPostrouting is ours in the node's nat table.
	ChainPrerouting  = "ISTIO_PRERT"
	ChainOutput      = "ISTIO_OUTPUT"
	ChainPostrouting = "ISTIO_POSTRT"

	// ProbeSetV4 and ProbeSetV6 are the node's ipsets of pod IPs that get
	// probe SNAT. Istio's names, so a node switched from Istio's agent keeps
	// working and stale entries are recognised.
	ProbeSetV4 = "istio-inpod-probes-v4"
	ProbeSetV6 = "istio-inpod-probes-v6"
)

// ProbeSNATv4 and ProbeSNATv6 are the source addresses kubelet probes are
// rewritten to on the node; the in-pod rules let them through uncaptured.
var (
	ProbeSNATv4 = netip.MustParseAddr("169.254.7.127")
	ProbeSNATv6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// Family is an address family: IPv4 (iptables) or IPv6 (ip6tables).
type Family int

const (
	IPv4 Family = 4
	IPv6 Family = 6
)

func (f Family) String() string {
	if f == IPv6 {
		return "ip6tables"
	}
	return "iptables"
}

func (f Family) localhost() string {
	if f == IPv6 {
		return "::1/128"
	}
	return "127.0.0.1/32"
}

func (f Family) probeSNAT() netip.Addr {
	if f == IPv6 {
		return ProbeSNATv6
	}
	return ProbeSNATv4
}

func (f Family) probeSet() string {
	if f == IPv6 {
		return ProbeSetV6
	}
	return ProbeSetV4
}

func hostPrefix(a netip.Addr) string {
	return netip.PrefixFrom(a, a.BitLen()).String()
}

// PodOptions are the per-pod choices (the agent derives them from the pod's
// annotations and Config.DNSCapture).
type PodOptions struct {
	// BypassInbound drops the inbound redirect (and the probe accept that
	// only matters for it).
	BypassInbound bool
	// DNSCapture redirects the pod's DNS to ztunnel's 15053.
	DNSCapture bool
	// RerouteInterfaces is a comma-separated list of the pod's virtual
	// interfaces (e.g. a KubeVirt VM's tap0) whose TCP is sent to ztunnel's
	// outbound port, in addition to Config.RerouteInterfaces. A string, not
	// a slice, so PodOptions stays comparable (the rule cache's key).
	RerouteInterfaces string
}

// Validate checks the options, naming what is wrong.
func (o PodOptions) Validate() error {
	if o.RerouteInterfaces == "" {
		return nil
	}
	for _, i := range strings.Split(o.RerouteInterfaces, ",") {
		if err := ValidInterfaceName(i); err != nil {
			return err
		}
	}
	return nil
}

// ValidInterfaceName reports whether name can be a Linux interface name
// (1-15 bytes, no whitespace, '/', quotes, '!' or ',', not . or ..): what the
// rule tools accept and what cannot smuggle another match into a rule.
func ValidInterfaceName(name string) error {
	if name == "" || len(name) > 15 || strings.ContainsAny(name, " \t\n/!\"',") || name == "." || name == ".." {
		return fmt.Errorf("reroute interface %q is not a valid interface name", name)
	}
	return nil
}

// rerouteInterfaces is the node's reroute interfaces followed by the pod's
// own, each once.
func rerouteInterfaces(cfg Config, opts PodOptions) []string {
	out := slices.Clone(cfg.RerouteInterfaces)
	if opts.RerouteInterfaces != "" {
		for _, i := range strings.Split(opts.RerouteInterfaces, ",") {
			if !slices.Contains(out, i) {
				out = append(out, i)
			}
		}
	}
	return out
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
func (rs RuleSet) Families() []Family {
	if rs.V6 != nil {
		return []Family{IPv4, IPv6}
	}
	return []Family{IPv4}
}

// Rules returns the rules of one family.
func (rs RuleSet) Rules(f Family) []Rule {
	if f == IPv6 {
		return rs.V6
	}
	return rs.V4
}

// chains returns our chains of one table, in jump order.
func (rs RuleSet) chains(table string) []string {
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

// BuildPodRules returns the in-pod rule set for the given node config and pod
// options. It touches nothing.
func BuildPodRules(cfg Config, opts PodOptions) RuleSet {
	rs := RuleSet{Tables: podTables}
	for _, t := range podTables {
		rs.Jumps = append(rs.Jumps,
			Jump{Table: t, From: "PREROUTING", To: ChainPrerouting},
			Jump{Table: t, From: "OUTPUT", To: ChainOutput})
	}
	rs.V4 = podRules(IPv4, cfg, opts)
	if cfg.IPv6 {
		rs.V6 = podRules(IPv6, cfg, opts)
	}
	return rs
}

func podRules(f Family, cfg Config, opts PodOptions) []Rule {
	var (
		mark     = hex(ProxyMark) + "/" + hex(MarkMask)
		connmark = hex(ConnMark) + "/" + hex(MarkMask)
		lo       = f.localhost()
		probe    = hostPrefix(f.probeSNAT())
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
	for _, iface := range rerouteInterfaces(cfg, opts) {
		add("nat", ChainPrerouting, "-i", iface, "-p", "tcp", "-j", "REDIRECT", "--to-ports", strconv.Itoa(OutboundPort))
	}
	if !opts.BypassInbound {
		// Kubelet probes arrive SNATed to the probe address: not captured.
		add("nat", ChainPrerouting, "-s", probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
		add("nat", ChainPrerouting, "!", "-d", lo, "-p", "tcp", "-m", "tcp", "!", "--dport", strconv.Itoa(HBONEPort),
			"-m", "mark", "!", "--mark", mark, "-j", "REDIRECT", "--to-ports", strconv.Itoa(InboundPort))
	}

	// nat OUTPUT: traffic the pod sends.
	add("nat", ChainOutput, "-d", probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
	if opts.DNSCapture {
		add("nat", ChainOutput, "!", "-o", "lo", "-p", "udp", "-m", "mark", "!", "--mark", mark,
			"-m", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", strconv.Itoa(DNSPort))
		add("nat", ChainOutput, "!", "-d", lo, "-p", "tcp", "-m", "tcp", "--dport", "53",
			"-m", "mark", "!", "--mark", mark, "-j", "REDIRECT", "--to-ports", strconv.Itoa(DNSPort))
	}
	add("nat", ChainOutput, "-p", "tcp", "-m", "mark", "--mark", connmark, "-j", "ACCEPT")
	add("nat", ChainOutput, "!", "-d", lo, "-o", "lo", "-j", "ACCEPT")
	add("nat", ChainOutput, "!", "-d", lo, "-p", "tcp", "-m", "mark", "!", "--mark", mark,
		"-j", "REDIRECT", "--to-ports", strconv.Itoa(OutboundPort))

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
func BuildHostRules(cfg Config) RuleSet {
	rs := RuleSet{
		Tables: []string{"nat"},
		Jumps:  []Jump{{Table: "nat", From: "POSTROUTING", To: ChainPostrouting, First: true}},
	}
	rs.V4 = hostRules(IPv4)
	if cfg.IPv6 {
		rs.V6 = hostRules(IPv6)
	}
	return rs
}

func hostRules(f Family) []Rule {
	return []Rule{{Table: "nat", Chain: ChainPostrouting, Args: []string{
		"-p", "tcp", "-m", "owner", "--socket-exists", "-m", "set", "--match-set", f.probeSet(), "dst",
		"-j", "SNAT", "--to-source", f.probeSNAT().String()}}}
}

func hex(v int) string { return "0x" + strconv.FormatInt(int64(v), 16) }
