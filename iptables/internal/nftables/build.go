package nftables

import (
	"net/netip"

	nft "github.com/google/nftables"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

func podTable(name string, prerouting, output Chain) Table {
	return Table{
		Name: name,
		Chains: []Chain{prerouting, output,
			{Name: ChainPrerouting}, {Name: ChainOutput}},
		Rules: []Rule{
			{Chain: BasePrerouting, stmts: []statement{jump(ChainPrerouting)}},
			{Chain: BaseOutput, stmts: []statement{jump(ChainOutput)}},
		},
	}
}

func baseChain(name string, typ nft.ChainType, hook *nft.ChainHook, prio int32) Chain {
	return Chain{Name: name, Type: typ, Hook: hook, Priority: prio}
}

// BuildPodRules returns the in-pod rule set for the nftables backend: the
// same capture as the iptables backends' (xtables.BuildPodRules), in Istio's
// native-nftables layout. One inet
// table covers both families; rules that match no address apply to both and,
// with IPv6 off, are pinned to IPv4 so IPv6 stays uncaptured exactly as with
// the iptables backends. All three tables always exist (raw's chains stay
// empty without DNS capture), so delete needs no options.
func BuildPodRules(n rules.Node, opts rules.PodOptions) RuleSet {
	fams := n.Families()
	// agnostic prefixes a family-agnostic rule: nothing with IPv6 on, IPv4 only
	// with IPv6 off.
	agnostic := func(s ...statement) []statement {
		if !n.IPv6 {
			s = append([]statement{nfproto(rules.IPv4)}, s...)
		}
		return s
	}
	lo := func(f rules.Family) netip.Addr {
		if f == rules.IPv6 {
			return netip.IPv6Loopback()
		}
		return netip.MustParseAddr("127.0.0.1")
	}

	nat := podTable(TableNat,
		baseChain(BasePrerouting, nft.ChainTypeNAT, nft.ChainHookPrerouting, nftPriorityDstNAT),
		baseChain(BaseOutput, nft.ChainTypeNAT, nft.ChainHookOutput, nftPriorityDstNAT))
	mangle := podTable(TableMangle,
		baseChain(BasePrerouting, nft.ChainTypeFilter, nft.ChainHookPrerouting, nftPriorityMangle),
		// route type: a mark restored here re-routes the packet (policy route).
		baseChain(BaseOutput, nft.ChainTypeRoute, nft.ChainHookOutput, nftPriorityMangle))
	raw := podTable(TableRaw,
		baseChain(BasePrerouting, nft.ChainTypeFilter, nft.ChainHookPrerouting, nftPriorityRaw),
		baseChain(BaseOutput, nft.ChainTypeFilter, nft.ChainHookOutput, nftPriorityRaw))

	add := func(t *Table, chain string, s ...statement) {
		// Every rule counts, as Istio's do: `nft list` shows what matched.
		s = append(s[:len(s)-1:len(s)-1], counter(), s[len(s)-1])
		t.Rules = append(t.Rules, Rule{Chain: chain, stmts: s})
	}

	add(&mangle, ChainPrerouting, agnostic(mark(false, rules.ProxyMark), setConnmark())...)
	add(&mangle, ChainOutput, agnostic(ctmark(rules.ConnMark), restoreMark())...)

	for _, iface := range rules.RerouteInterfaces(n, opts) {
		add(&nat, ChainPrerouting, agnostic(ifname("iifname", false, iface), l4proto("tcp"), redirect(rules.OutboundPort))...)
	}
	if !opts.BypassInbound {
		for _, f := range fams {
			add(&nat, ChainPrerouting, l4proto("tcp"), addr("saddr", false, f.ProbeSNAT()), accept())
		}
		for _, f := range fams {
			add(&nat, ChainPrerouting, addr("daddr", true, lo(f)), port("tcp", "dport", true, rules.HBONEPort),
				mark(true, rules.ProxyMark), redirect(rules.InboundPort))
		}
	}
	for _, f := range fams {
		add(&nat, ChainOutput, l4proto("tcp"), addr("daddr", false, f.ProbeSNAT()), accept())
	}
	if opts.DNSCapture {
		add(&nat, ChainOutput, agnostic(ifname("oifname", true, "lo"), mark(true, rules.ProxyMark), port("udp", "dport", false, 53), redirect(rules.DNSPort))...)
		for _, f := range fams {
			add(&nat, ChainOutput, addr("daddr", true, lo(f)), port("tcp", "dport", false, 53), mark(true, rules.ProxyMark), redirect(rules.DNSPort))
		}
	}
	add(&nat, ChainOutput, agnostic(l4proto("tcp"), mark(false, rules.ConnMark), accept())...)
	for _, f := range fams {
		add(&nat, ChainOutput, ifname("oifname", false, "lo"), addr("daddr", true, lo(f)), accept())
	}
	for _, f := range fams {
		add(&nat, ChainOutput, l4proto("tcp"), addr("daddr", true, lo(f)), mark(true, rules.ProxyMark), redirect(rules.OutboundPort))
	}

	if opts.DNSCapture {
		add(&raw, ChainPrerouting, agnostic(port("udp", "sport", false, 53), mark(true, rules.ProxyMark), ctZone(1))...)
		add(&raw, ChainOutput, agnostic(port("udp", "dport", false, 53), mark(false, rules.ProxyMark), ctZone(1))...)
	}
	return RuleSet{Tables: []Table{nat, mangle, raw}}
}

// BuildHostRules returns the node's probe SNAT rules for the nftables
// backend, as Istio keys them: TCP from the kubelet's uid to an address in
// the probe set leaves with the probe source address.
func BuildHostRules(n rules.Node, kubeletUID uint32) RuleSet {
	t := Table{
		Name:   TableNat,
		Chains: []Chain{baseChain(BasePostrouting, nft.ChainTypeNAT, nft.ChainHookPostrouting, nftPrioritySrcNAT)},
	}
	fams := n.Families()
	for _, f := range fams {
		t.Sets = append(t.Sets, Set{Name: f.ProbeSet(), V6: f == rules.IPv6})
	}
	for _, f := range fams {
		t.Rules = append(t.Rules, Rule{Chain: BasePostrouting, stmts: []statement{
			l4proto("tcp"), skuid(kubeletUID), inSet(f, f.ProbeSet()), counter(), snatTo(f.ProbeSNAT()),
		}})
	}
	return RuleSet{Tables: []Table{t}}
}
