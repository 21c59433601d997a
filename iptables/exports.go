package iptables

import (
	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// The shared vocabulary (package rules) and the rule sets as data (packages
// xtables and nftables), re-exported so callers need only this package.

// Marks, ports, addresses and names of the in-pod rules (docs/rules.md).
const (
	ProxyMark    = rules.ProxyMark
	ConnMark     = rules.ConnMark
	MarkMask     = rules.MarkMask
	RouteTable   = rules.RouteTable
	RulePriority = rules.RulePriority

	OutboundPort = rules.OutboundPort
	InboundPort  = rules.InboundPort
	HBONEPort    = rules.HBONEPort
	DNSPort      = rules.DNSPort

	// ProbeSetV4 and ProbeSetV6 are the node's sets of pod IPs that get
	// probe SNAT.
	ProbeSetV4 = rules.ProbeSetV4
	ProbeSetV6 = rules.ProbeSetV6

	// The nftables backend's tables (Istio's native-nftables layout).
	NFTTableNat    = nftables.TableNat
	NFTTableMangle = nftables.TableMangle
	NFTTableRaw    = nftables.TableRaw
)

// ProbeSNATv4 is the source address kubelet probes are rewritten to on an
// IPv4 node; the in-pod rules let it through uncaptured.
var ProbeSNATv4 = rules.ProbeSNATv4

type (
	// Family is an address family: IPv4 (iptables) or IPv6 (ip6tables).
	Family = rules.Family
	// PodOptions are the per-pod choices (the agent derives them from the
	// pod's annotations and its DNS capture default).
	PodOptions = rules.PodOptions
	// Drift is the difference between the rules a pod (or the node) should
	// have and the rules it has, one readable line per rule.
	Drift = rules.Drift
	// RuleSet is the iptables backends' rule set (chains, jumps, rules per
	// family), rendered to iptables-restore text.
	RuleSet = xtables.RuleSet
	// NFTRuleSet is the nftables backend's rule set (inet tables, chains,
	// rules), rendered as `nft list` prints it; NFTChain is one of its
	// chains.
	NFTRuleSet = nftables.RuleSet
	NFTChain   = nftables.Chain
)

const (
	IPv4 = rules.IPv4
	IPv6 = rules.IPv6
)

// ValidInterfaceName reports whether name is one exact interface name (no
// wildcard, nothing that could smuggle another match into a rule): every
// backend then matches exactly that interface.
func ValidInterfaceName(name string) error { return rules.ValidInterfaceName(name) }

// MaxInterfaceNameLen is the longest Linux interface name.
const MaxInterfaceNameLen = rules.MaxInterfaceNameLen

// BuildPodRules returns the in-pod rule set of the iptables backends for the
// given node config and pod options. It touches nothing.
func BuildPodRules(cfg Config, opts PodOptions) RuleSet {
	return xtables.BuildPodRules(cfg.node(), opts)
}

// BuildHostRules returns the node's probe SNAT rule set of the iptables
// backends.
func BuildHostRules(cfg Config) RuleSet { return xtables.BuildHostRules(cfg.node()) }

// BuildPodRulesNFT returns the in-pod rule set of the nftables backend: the
// same capture as BuildPodRules, in Istio's native-nftables layout.
func BuildPodRulesNFT(cfg Config, opts PodOptions) NFTRuleSet {
	return nftables.BuildPodRules(cfg.node(), opts)
}

// BuildHostRulesNFT returns the node's probe SNAT rules of the nftables
// backend, keyed on the kubelet's uid as Istio keys them.
func BuildHostRulesNFT(cfg Config, kubeletUID uint32) NFTRuleSet {
	return nftables.BuildHostRules(cfg.node(), kubeletUID)
}
