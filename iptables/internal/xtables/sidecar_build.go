package xtables

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// BuildSidecarRules returns a pod's sidecar rules: what Istio's istio-cni
// programs for the same pod (the oracle tests compare them chain by chain
// with Istio's own builder), in the canonical text iptables-save prints.
func BuildSidecarRules(o rules.SidecarOptions) SidecarRuleSet {
	rs := SidecarRuleSet{V4: sidecarFamily(rules.IPv4, o)}
	if o.IPv6 {
		rs.V6 = sidecarFamily(rules.IPv6, o)
	}
	return rs
}

// sidecarFamily builds one family's rules in the order Istio's builder
// adds them: each part appends to (or inserts into) the chains the parts
// before it wrote, so the order of the calls is the kernel's order.
func sidecarFamily(f rules.Family, o rules.SidecarOptions) *SidecarFamily {
	b := newSidecarBuilder(f, o)
	b.exclusions()
	b.inbound()
	b.outboundFirst()
	b.proxyOwner("uid", b.uid, o.DNS)
	b.proxyOwner("gid", b.gid, false)
	if o.DNS {
		b.dns()
	}
	b.outboundDestinations()
	if o.TProxy() {
		b.tproxyMarks()
	}
	return b.family()
}

// sidecarBuilder is one family's rules being built, with the values every
// part writes them with.
type sidecarBuilder struct {
	chainList
	f rules.Family
	o rules.SidecarOptions
	// lo is the family's loopback, pass Envoy's inbound passthrough source;
	// tmark and omark the TPROXY and outbound marks; tunnel the HBONE port;
	// uid and gid the proxy's; onIP TPROXY's any-address; inTbl the table
	// inbound capture lives in (mangle with TPROXY, else nat).
	lo, pass, tmark, omark, tunnel, uid, gid, onIP, inTbl string
}

// fullMask is the mark mask iptables-save prints after a --set-xmark.
const fullMask = "/0xffffffff"

func newSidecarBuilder(f rules.Family, o rules.SidecarOptions) *sidecarBuilder {
	b := &sidecarBuilder{
		f: f, o: o,
		lo:     localhost(f),
		pass:   hostPrefix(rules.SidecarInboundPassthrough(f)),
		tmark:  hex(rules.SidecarTProxyMark),
		omark:  hex(rules.SidecarOutboundMark),
		tunnel: strconv.Itoa(rules.SidecarTunnelPort),
		uid:    strconv.FormatUint(uint64(o.ProxyUID), 10),
		gid:    strconv.FormatUint(uint64(o.ProxyGID), 10),
		onIP:   "0.0.0.0",
		inTbl:  "nat",
	}
	if f == rules.IPv6 {
		b.onIP = "::"
	}
	if o.TProxy() {
		b.inTbl = "mangle"
	}
	return b
}

func port(p uint16) string { return strconv.Itoa(int(p)) }

// exclusions: excluded and rerouted interfaces, invalid packets, and the
// fixed rules of the redirect chains.
func (b *sidecarBuilder) exclusions() {
	o := b.o
	// Traffic on an excluded interface is never captured.
	for _, i := range o.ExcludeInterfaces {
		b.add("nat", "PREROUTING", "-i", i, "-j", "RETURN")
		b.add("nat", "OUTPUT", "-o", i, "-j", "RETURN")
	}
	if o.TProxy() {
		for _, i := range o.ExcludeInterfaces {
			b.add("mangle", "PREROUTING", "-i", i, "-j", "RETURN")
			b.add("mangle", "OUTPUT", "-o", i, "-j", "RETURN")
		}
	}
	// A VM's interface is not inbound traffic of the pod (its TCP is
	// captured as outbound below, inserted before this).
	for _, i := range o.RerouteInterfaces {
		b.insert("nat", "PREROUTING", 1, "-i", i, "-j", "RETURN")
	}
	if o.InvalidDrop {
		b.add("mangle", "PREROUTING", fields("-m conntrack --ctstate INVALID -j "+ChainSidecarDrop)...)
		b.add("mangle", ChainSidecarDrop, "-j", "DROP")
	}
	b.add("nat", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+b.tunnel+" -j RETURN")...)
	b.add("nat", ChainSidecarRedirect, fields("-p tcp -j REDIRECT --to-ports "+strconv.Itoa(rules.SidecarOutboundPort))...)
	b.add("nat", ChainSidecarInRedirect, fields("-p tcp -j REDIRECT --to-ports "+strconv.Itoa(rules.SidecarInboundPort))...)
}

// inbound captures the pod's inbound TCP to Envoy's inbound port: every
// port but the excluded ones, or the included ones only.
func (b *sidecarBuilder) inbound() {
	o := b.o
	if !o.InboundCaptured() {
		return
	}
	if o.TProxy() {
		b.add("mangle", ChainSidecarDivert, fields("-j MARK --set-xmark "+b.tmark+fullMask)...)
		b.add("mangle", ChainSidecarDivert, "-j", "ACCEPT")
		b.add("mangle", ChainSidecarTProxy, fields("! -d "+b.lo+" -p tcp -j TPROXY --on-port "+strconv.Itoa(rules.SidecarInboundPort)+
			" --on-ip "+b.onIP+" --tproxy-mark "+b.tmark+fullMask)...)
	}
	b.add(b.inTbl, "PREROUTING", "-p", "tcp", "-j", ChainSidecarInbound)
	if o.IncludeAllInbound {
		for _, p := range o.ExcludeInboundPorts {
			b.add(b.inTbl, ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -j RETURN")...)
		}
		if o.TProxy() {
			b.add("mangle", ChainSidecarInbound, fields("-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j "+ChainSidecarDivert)...)
			b.add("mangle", ChainSidecarInbound, "-p", "tcp", "-j", ChainSidecarTProxy)
		} else {
			b.add("nat", ChainSidecarInbound, "-p", "tcp", "-j", ChainSidecarInRedirect)
		}
		return
	}
	for _, p := range o.IncludeInboundPorts {
		if o.TProxy() {
			b.add("mangle", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -m conntrack --ctstate RELATED,ESTABLISHED -j "+ChainSidecarDivert)...)
			b.add("mangle", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -j "+ChainSidecarTProxy)...)
		} else {
			b.add("nat", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -j "+ChainSidecarInRedirect)...)
		}
	}
}

// outboundFirst starts the output chain: the excluded ports and Envoy's
// inbound passthrough, which are never captured.
func (b *sidecarBuilder) outboundFirst() {
	b.add("nat", "OUTPUT", "-j", ChainSidecarOutput)
	for _, p := range b.o.ExcludeOutboundPorts {
		b.add("nat", ChainSidecarOutput, fields("-p tcp -m tcp --dport "+port(p)+" -j RETURN")...)
		b.add("nat", ChainSidecarOutput, fields("-p udp -m udp --dport "+port(p)+" -j RETURN")...)
	}
	// Envoy's inbound passthrough (bound to 127.0.0.6) is not captured.
	b.add("nat", ChainSidecarOutput, fields("-s "+b.pass+" -o lo -j RETURN")...)
}

// proxyOwner keeps the proxy's own traffic (by kind uid or gid, id) out of
// capture, but for its calls to the pod's own address.
func (b *sidecarBuilder) proxyOwner(kind, id string, dnsException bool) {
	// The proxy calling the pod's own address (a service VIP that
	// resolved to this pod) goes through Envoy's inbound side.
	if dnsException {
		b.add("nat", ChainSidecarOutput, fields("! -d "+b.lo+" -o lo -p tcp -m multiport ! --dports 53,"+b.tunnel+
			" -m owner --"+kind+"-owner "+id+" -j "+ChainSidecarInRedirect)...)
	} else {
		b.add("nat", ChainSidecarOutput, fields("! -d "+b.lo+" -o lo -p tcp -m tcp ! --dport "+b.tunnel+
			" -m owner --"+kind+"-owner "+id+" -j "+ChainSidecarInRedirect)...)
	}
	// Other loopback traffic is the app talking to itself.
	if !b.o.IncludesLoopback() {
		if b.o.DNS {
			b.add("nat", ChainSidecarOutput, fields("-o lo -p tcp -m tcp ! --dport 53 -m owner ! --"+kind+"-owner "+id+" -j RETURN")...)
		} else {
			b.add("nat", ChainSidecarOutput, fields("-o lo -m owner ! --"+kind+"-owner "+id+" -j RETURN")...)
		}
	}
	// The proxy's own traffic is never captured again.
	b.add("nat", ChainSidecarOutput, fields("-m owner --"+kind+"-owner "+id+" -j RETURN")...)
}

// dns redirects the pod's DNS to the proxy's DNS port, with conntrack
// zones that keep the proxy's upstream queries apart from the app's.
func (b *sidecarBuilder) dns() {
	dns := strconv.Itoa(rules.SidecarDNSPort)
	b.add("raw", "OUTPUT", "-j", ChainSidecarOutputDNS)
	b.add("nat", ChainSidecarOutput, "-j", ChainSidecarOutputDNS)
	b.add("nat", ChainSidecarOutputDNS, fields("-p tcp -m tcp --dport 53 -j REDIRECT --to-ports "+dns)...)
	b.add("nat", ChainSidecarOutputDNS, fields("-p udp -m udp --dport 53 -j REDIRECT --to-ports "+dns)...)
	// The proxy's upstream queries (zone 1) never share conntrack
	// entries with the app's queries it answers (zone 2).
	for _, id := range []struct{ kind, v string }{{"uid", b.uid}, {"gid", b.gid}} {
		b.add("raw", ChainSidecarOutputDNS, fields("-p udp -m udp --dport 53 -m owner --"+id.kind+"-owner "+id.v+" -j CT --zone 1")...)
		b.add("raw", ChainSidecarOutputDNS, fields("-p udp -m udp --sport "+dns+" -m owner --"+id.kind+"-owner "+id.v+" -j CT --zone 2")...)
	}
	b.add("raw", "PREROUTING", "-j", ChainSidecarInbound)
	b.add("raw", ChainSidecarOutputDNS, fields("-p udp -m udp --dport 53 -j CT --zone 2")...)
	b.add("raw", ChainSidecarInbound, fields("-p udp -m udp --sport 53 -j CT --zone 1")...)
}

// outboundDestinations captures outbound traffic to Envoy's outbound
// port: all of it or the included ports and CIDRs, never loopback or the
// excluded CIDRs; a VM's interface's TCP likewise.
func (b *sidecarBuilder) outboundDestinations() {
	o, f := b.o, b.f
	b.add("nat", ChainSidecarOutput, "-d", b.lo, "-j", "RETURN")
	for _, c := range rules.OutboundCIDRs(o.ExcludeOutboundCIDRs, f) {
		b.add("nat", ChainSidecarOutput, "-d", cidr(c), "-j", "RETURN")
	}
	for _, p := range o.IncludeOutboundPorts {
		b.add("nat", ChainSidecarOutput, fields("-p tcp -m tcp --dport "+port(p)+" -j "+ChainSidecarRedirect)...)
	}
	if o.IncludeAllOutbound {
		b.add("nat", ChainSidecarOutput, "-j", ChainSidecarRedirect)
		for _, i := range o.RerouteInterfaces {
			b.insert("nat", "PREROUTING", 1, "-i", i, "-j", ChainSidecarRedirect)
		}
		return
	}
	for _, c := range rules.OutboundCIDRs(o.IncludeOutboundCIDRs, f) {
		for _, i := range o.RerouteInterfaces {
			b.insert("nat", "PREROUTING", 1, "-d", cidr(c), "-i", i, "-j", ChainSidecarRedirect)
		}
		b.add("nat", ChainSidecarOutput, "-d", cidr(c), "-j", ChainSidecarRedirect)
	}
}

// tproxyMarks keep TPROXY'd connections' replies on the TPROXY route.
func (b *sidecarBuilder) tproxyMarks() {
	tmark, omark := b.tmark, b.omark
	// Envoy's original-src mark survives as the connection's mark;
	// the pod's replies get it back and take the TPROXY route.
	b.add("mangle", "PREROUTING", fields("-p tcp -m mark --mark "+tmark+" -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff")...)
	b.add("mangle", "OUTPUT", fields("-o lo -p tcp -m mark --mark "+tmark+" -j RETURN")...)
	for _, id := range []struct{ kind, v string }{{"uid", b.uid}, {"gid", b.gid}} {
		b.add("mangle", "OUTPUT", fields("! -d "+b.lo+" -o lo -p tcp -m owner --"+id.kind+"-owner "+id.v+" -j MARK --set-xmark "+omark+fullMask)...)
	}
	b.add("mangle", "OUTPUT", fields("-p tcp -m connmark --mark "+tmark+" -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff")...)
	b.insert("mangle", ChainSidecarInbound, 1, fields("-p tcp -m mark --mark "+tmark+" -j RETURN")...)
	b.insert("mangle", ChainSidecarInbound, 2, fields("-s "+b.pass+" -i lo -p tcp -j RETURN")...)
	b.insert("mangle", ChainSidecarInbound, 3, fields("-i lo -p tcp -m mark ! --mark "+omark+" -j RETURN")...)
}

func fields(s string) []string { return strings.Fields(s) }

// cidr is a prefix as iptables-save prints it (host bits cleared).
func cidr(p netip.Prefix) string { return p.Masked().String() }

// chainList builds one family's rules the way Istio's builder does: rules
// appended or inserted at a 1-based position (iptables -I), so the kernel
// order is data, not an accident of rendering.
type chainList struct {
	order []string // "table/chain" in first-use order
	rules map[string][][]string
}

func (l *chainList) at(table, chain string) string {
	k := table + "/" + chain
	if l.rules == nil {
		l.rules = map[string][][]string{}
	}
	if _, ok := l.rules[k]; !ok {
		l.order = append(l.order, k)
		l.rules[k] = nil
	}
	return k
}

func (l *chainList) add(table, chain string, args ...string) {
	k := l.at(table, chain)
	l.rules[k] = append(l.rules[k], args)
}

func (l *chainList) insert(table, chain string, pos int, args ...string) {
	k := l.at(table, chain)
	i := min(max(pos-1, 0), len(l.rules[k]))
	l.rules[k] = slices.Insert(l.rules[k], i, args)
}

func (l *chainList) family() *SidecarFamily {
	sf := &SidecarFamily{Chains: map[string][]string{}}
	for _, k := range l.order {
		table, chain, _ := strings.Cut(k, "/")
		if !builtin(chain) {
			sf.Chains[table] = append(sf.Chains[table], chain)
		}
		for _, args := range l.rules[k] {
			sf.Rules = append(sf.Rules, Rule{Table: table, Chain: chain, Args: args})
		}
	}
	// A chain only jumped to (never given a rule) is ours too.
	for _, r := range sf.Rules {
		if target, ok := JumpTarget(strings.Join(r.Args, " ")); ok && slices.Contains(sidecarChains[r.Table], target) &&
			!slices.Contains(sf.Chains[r.Table], target) {
			sf.Chains[r.Table] = append(sf.Chains[r.Table], target)
		}
	}
	return sf
}
