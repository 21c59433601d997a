package nftables

import (
	"net/netip"

	"github.com/google/nftables/expr"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// BuildSidecarRules returns a pod's sidecar rules in Istio's native
// nftables layout: the same capture as xtables.BuildSidecarRules, one inet
// rule set for both families (the IPv6 matches only when the pod's IPv6 is
// captured), in the order Istio's builder leaves them: each part below
// appends to (or inserts into) the chains the parts before it wrote, so the
// order of the calls is the order of the rules.
func BuildSidecarRules(o rules.SidecarOptions) RuleSet {
	b := &sidecarBuilder{nftList: nftList{rules: map[string][]Rule{}}, o: o, v6: o.IPv6}
	b.exclusions()
	switch {
	case !o.InboundCaptured():
	case o.TProxy():
		b.inboundTProxy()
	default:
		b.inboundRedirect()
	}
	b.outboundFirst()
	b.proxyOwner(expr.MetaKeySKUID, o.ProxyUID, o.DNS)
	b.proxyOwner(expr.MetaKeySKGID, o.ProxyGID, false)
	if o.DNS {
		b.dns()
	}
	b.outboundDestinations()
	if o.TProxy() {
		b.tproxyMarks()
	}
	return b.ruleSet()
}

// sidecarBuilder is a pod's sidecar rules being built.
type sidecarBuilder struct {
	nftList
	o  rules.SidecarOptions
	v6 bool // the pod's IPv6 is captured
}

// The tables of the sidecar rules, as the builder's parts name them.
const (
	nat    = TableSidecarNat
	mangle = TableSidecarMangle
	raw    = TableSidecarRaw
)

var (
	loopback4 = netip.PrefixFrom(netip.MustParseAddr("127.0.0.1"), 32)
	loopback6 = netip.PrefixFrom(netip.IPv6Loopback(), 128)
)

// loopbacks are the loopback prefixes of the captured families.
func (b *sidecarBuilder) loopbacks() []netip.Prefix {
	if b.v6 {
		return []netip.Prefix{loopback4, loopback6}
	}
	return []netip.Prefix{loopback4}
}

// proxyIDs are the proxy's uid and gid, as socket owner matches.
func (b *sidecarBuilder) proxyIDs() []proxyID {
	return []proxyID{{expr.MetaKeySKUID, b.o.ProxyUID}, {expr.MetaKeySKGID, b.o.ProxyGID}}
}

type proxyID struct {
	key expr.MetaKey
	v   uint32
}

// exclusions: excluded and rerouted interfaces, invalid packets, and the
// fixed rules of the redirect chains.
func (b *sidecarBuilder) exclusions() {
	o := b.o
	for _, i := range o.ExcludeInterfaces {
		b.add(nat, BasePrerouting, ifname("iifname", false, i), counter(), verdict(expr.VerdictReturn))
		b.add(nat, BaseOutput, ifname("oifname", false, i), counter(), verdict(expr.VerdictReturn))
	}
	if o.TProxy() {
		for _, i := range o.ExcludeInterfaces {
			b.add(mangle, BasePrerouting, ifname("iifname", false, i), counter(), verdict(expr.VerdictReturn))
			b.add(mangle, BaseOutput, ifname("oifname", false, i), counter(), verdict(expr.VerdictReturn))
		}
	}
	for _, i := range o.RerouteInterfaces {
		b.insert(nat, BasePrerouting, 0, ifname("iifname", false, i), counter(), verdict(expr.VerdictReturn))
	}
	if o.InvalidDrop {
		b.add(mangle, BasePrerouting, l4proto("tcp"), ctState(expr.CtStateBitINVALID), counter(), jump(chainDrop))
		b.add(mangle, chainDrop, counter(), verdict(expr.VerdictDrop))
	}
	b.add(nat, chainInbound, port("tcp", "dport", false, rules.SidecarTunnelPort), counter(), verdict(expr.VerdictReturn))
	b.add(nat, chainRedirect, l4proto("tcp"), counter(), redirect(rules.SidecarOutboundPort))
	b.add(nat, chainInRedirect, l4proto("tcp"), counter(), redirect(rules.SidecarInboundPort))
}

// inboundTProxy captures inbound TCP to Envoy's inbound port by TPROXY.
func (b *sidecarBuilder) inboundTProxy() {
	o := b.o
	tmark := uint32(rules.SidecarTProxyMark)
	b.add(mangle, chainDivert, counter(), markSet(tmark))
	b.add(mangle, chainDivert, counter(), accept())
	b.add(mangle, chainTProxy, l4proto("tcp"), prefix("daddr", true, loopback4), tproxyTo(rules.IPv4, rules.SidecarInboundPort), markSet(tmark), counter(), accept())
	if b.v6 {
		b.add(mangle, chainTProxy, l4proto("tcp"), prefix("daddr", true, loopback6), tproxyTo(rules.IPv6, rules.SidecarInboundPort), markSet(tmark), counter(), accept())
	}
	b.add(mangle, BasePrerouting, l4proto("tcp"), counter(), jump(chainInbound))
	if o.IncludeAllInbound {
		for _, p := range o.ExcludeInboundPorts {
			b.add(mangle, chainInbound, port("tcp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
		}
		b.add(mangle, chainInbound, l4proto("tcp"), ctState(expr.CtStateBitRELATED|expr.CtStateBitESTABLISHED), counter(), jump(chainDivert))
		b.add(mangle, chainInbound, l4proto("tcp"), counter(), jump(chainTProxy))
		return
	}
	for _, p := range o.IncludeInboundPorts {
		b.add(mangle, chainInbound, l4protoImplied("tcp"), ctState(expr.CtStateBitRELATED|expr.CtStateBitESTABLISHED),
			portOnly("tcp", "dport", false, p), counter(), jump(chainDivert))
		b.add(mangle, chainInbound, port("tcp", "dport", false, p), counter(), jump(chainTProxy))
	}
}

// inboundRedirect captures inbound TCP to Envoy's inbound port by NAT.
func (b *sidecarBuilder) inboundRedirect() {
	o := b.o
	b.add(nat, BasePrerouting, l4proto("tcp"), counter(), jump(chainInbound))
	if o.IncludeAllInbound {
		for _, p := range o.ExcludeInboundPorts {
			b.add(nat, chainInbound, port("tcp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
		}
		b.add(nat, chainInbound, l4proto("tcp"), counter(), jump(chainInRedirect))
		return
	}
	for _, p := range o.IncludeInboundPorts {
		b.add(nat, chainInbound, port("tcp", "dport", false, p), counter(), jump(chainInRedirect))
	}
}

// outboundFirst starts the output chain: the excluded ports and Envoy's
// inbound passthrough, which are never captured.
func (b *sidecarBuilder) outboundFirst() {
	b.add(nat, BaseOutput, counter(), jump(chainOutput))
	for _, p := range b.o.ExcludeOutboundPorts {
		b.add(nat, chainOutput, port("tcp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
		b.add(nat, chainOutput, port("udp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
	}
	b.add(nat, chainOutput, ifname("oifname", false, "lo"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv4)), counter(), verdict(expr.VerdictReturn))
	if b.v6 {
		b.add(nat, chainOutput, ifname("oifname", false, "lo"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv6)), counter(), verdict(expr.VerdictReturn))
	}
}

// proxyOwner keeps the proxy's own traffic (socket owner key = id) out of
// capture, but for its calls to the pod's own address.
func (b *sidecarBuilder) proxyOwner(key expr.MetaKey, id uint32, dnsException bool) {
	tunnel := portOnly("tcp", "dport", true, rules.SidecarTunnelPort)
	if dnsException {
		tunnel = b.portSet("tcp", "dport", true, 53, rules.SidecarTunnelPort)
	}
	for _, lo := range b.loopbacks() {
		b.add(nat, chainOutput, ifname("oifname", false, "lo"), l4protoImplied("tcp"), prefix("daddr", true, lo), tunnel,
			skid(key, false, id), counter(), jump(chainInRedirect))
	}
	if !b.o.IncludesLoopback() {
		if b.o.DNS {
			b.add(nat, chainOutput, ifname("oifname", false, "lo"), l4protoImplied("tcp"), portOnly("tcp", "dport", true, 53),
				skid(key, true, id), counter(), verdict(expr.VerdictReturn))
		} else {
			b.add(nat, chainOutput, ifname("oifname", false, "lo"), skid(key, true, id), counter(), verdict(expr.VerdictReturn))
		}
	}
	b.add(nat, chainOutput, skid(key, false, id), counter(), verdict(expr.VerdictReturn))
}

// dns redirects the pod's DNS to the proxy's DNS port, with conntrack
// zones that keep the proxy's upstream queries apart from the app's.
func (b *sidecarBuilder) dns() {
	b.add(raw, BaseOutput, counter(), jump(chainOutputDNS))
	b.add(nat, chainOutput, counter(), jump(chainOutputDNS))
	b.add(nat, chainOutputDNS, port("tcp", "dport", false, 53), counter(), redirect(rules.SidecarDNSPort))
	b.add(nat, chainOutputDNS, port("udp", "dport", false, 53), counter(), redirect(rules.SidecarDNSPort))
	for _, id := range b.proxyIDs() {
		b.add(raw, chainOutputDNS, port("udp", "dport", false, 53), skid(id.key, false, id.v), counter(), ctZone(1))
		b.add(raw, chainOutputDNS, port("udp", "sport", false, rules.SidecarDNSPort), skid(id.key, false, id.v), counter(), ctZone(2))
	}
	b.add(raw, BasePrerouting, counter(), jump(chainInbound))
	b.add(raw, chainOutputDNS, port("udp", "dport", false, 53), counter(), ctZone(2))
	b.add(raw, chainInbound, port("udp", "sport", false, 53), counter(), ctZone(1))
}

// outboundDestinations captures outbound traffic to Envoy's outbound
// port: all of it or the included ports and CIDRs, never loopback or the
// excluded CIDRs; a VM's interface's TCP likewise.
func (b *sidecarBuilder) outboundDestinations() {
	o := b.o
	for _, lo := range b.loopbacks() {
		b.add(nat, chainOutput, prefix("daddr", false, lo), counter(), verdict(expr.VerdictReturn))
	}
	for _, f := range rules.Families(b.v6) {
		for _, c := range rules.OutboundCIDRs(o.ExcludeOutboundCIDRs, f) {
			b.add(nat, chainOutput, prefix("daddr", false, c), counter(), verdict(expr.VerdictReturn))
		}
	}
	for _, p := range o.IncludeOutboundPorts {
		b.add(nat, chainOutput, port("tcp", "dport", false, p), counter(), jump(chainRedirect))
	}
	if o.IncludeAllOutbound {
		b.add(nat, chainOutput, counter(), jump(chainRedirect))
		for _, i := range o.RerouteInterfaces {
			b.insert(nat, BasePrerouting, 0, ifname("iifname", false, i), counter(), jump(chainRedirect))
		}
		return
	}
	for _, f := range rules.Families(b.v6) {
		for _, c := range rules.OutboundCIDRs(o.IncludeOutboundCIDRs, f) {
			for _, i := range o.RerouteInterfaces {
				b.insert(nat, BasePrerouting, 0, ifname("iifname", false, i), prefix("daddr", false, c), counter(), jump(chainRedirect))
			}
			b.add(nat, chainOutput, prefix("daddr", false, c), counter(), jump(chainRedirect))
		}
	}
}

// tproxyMarks keep TPROXY'd connections' replies on the TPROXY route.
func (b *sidecarBuilder) tproxyMarks() {
	tmark, omark := uint32(rules.SidecarTProxyMark), uint32(rules.SidecarOutboundMark)
	b.add(mangle, BasePrerouting, l4proto("tcp"), markIs(false, tmark), counter(), ctMarkSetMark())
	b.add(mangle, BaseOutput, ifname("oifname", false, "lo"), l4proto("tcp"), markIs(false, tmark), counter(), verdict(expr.VerdictReturn))
	for _, id := range b.proxyIDs() {
		for _, lo := range b.loopbacks() {
			b.add(mangle, BaseOutput, ifname("oifname", false, "lo"), l4proto("tcp"), prefix("daddr", true, lo), skid(id.key, false, id.v), counter(), markSet(omark))
		}
	}
	b.add(mangle, BaseOutput, l4proto("tcp"), ctMarkIs(tmark), counter(), restoreMark())
	b.insert(mangle, chainInbound, 0, l4proto("tcp"), markIs(false, tmark), counter(), verdict(expr.VerdictReturn))
	b.insert(mangle, chainInbound, 1, ifname("iifname", false, "lo"), l4proto("tcp"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv4)), counter(), verdict(expr.VerdictReturn))
	if b.v6 {
		b.insert(mangle, chainInbound, 1, ifname("iifname", false, "lo"), l4proto("tcp"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv6)), counter(), verdict(expr.VerdictReturn))
	}
	b.insert(mangle, chainInbound, 2, ifname("iifname", false, "lo"), l4proto("tcp"), markIs(true, omark), counter(), verdict(expr.VerdictReturn))
}
