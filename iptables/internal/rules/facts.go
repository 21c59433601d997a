package rules

import "net/netip"

// Marks, ports, addresses and names of the in-pod rules, Istio's (see
// docs/rules.md), so pods and nodes its agent set up are recognised and adopted.
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

	// ProbeSetV4 and ProbeSetV6 are the node's sets of pod IPs that get
	// probe SNAT (ipsets, or nftables sets in the nftables backend). Istio's
	// names, so a node switched from Istio's agent keeps working and stale
	// entries are recognised.
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

// String is the family's iptables program name, as drift lines and logs
// name it.
func (f Family) String() string {
	if f == IPv6 {
		return "ip6tables"
	}
	return "iptables"
}

// ProbeSNAT is the probe source address of the family.
func (f Family) ProbeSNAT() netip.Addr {
	if f == IPv6 {
		return ProbeSNATv6
	}
	return ProbeSNATv4
}

// ProbeSet is the name of the family's probe set.
func (f Family) ProbeSet() string {
	if f == IPv6 {
		return ProbeSetV6
	}
	return ProbeSetV4
}

// Families returns IPv4, and IPv6 when ipv6 is set.
func Families(ipv6 bool) []Family {
	if ipv6 {
		return []Family{IPv4, IPv6}
	}
	return []Family{IPv4}
}

// Mode names a rule backend.
type Mode string

const (
	// ModeLegacy and ModeNFT are iptables-restore batches of the legacy and
	// the nf_tables variant of the iptables tools.
	ModeLegacy Mode = "legacy"
	ModeNFT    Mode = "nft"
	// ModeNFTables is native nftables over netlink (Istio's nft layout), no
	// process spawned.
	ModeNFTables Mode = "nftables"
)
