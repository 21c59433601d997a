package nftables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	nft "github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Sidecar mode in native nftables: Istio's istio-proxy-* inet tables (the
// layout of istio-cni's native-nftables mode), so a pod Istio's agent set up
// verifies clean and one we set up is what Istio would have written.
const (
	TableSidecarNat    = "istio-proxy-nat"
	TableSidecarMangle = "istio-proxy-mangle"
	TableSidecarRaw    = "istio-proxy-raw"

	chainInbound    = "istio-inbound"
	chainRedirect   = "istio-redirect"
	chainInRedirect = "istio-in-redirect"
	chainOutput     = "istio-output"
	chainOutputDNS  = "istio-output-dns"
	chainDivert     = "istio-divert"
	chainTProxy     = "istio-tproxy"
	chainDrop       = "istio-drop"
)

// SidecarTables are the tables of the sidecar rules (each exists only
// when it has rules).
func SidecarTables() []string { return []string{TableSidecarNat, TableSidecarMangle, TableSidecarRaw} }

// sidecarLayout is each table's chains in creation order (base chains
// first, as Istio creates them); a chain is created only when it has rules.
var sidecarLayout = map[string][]Chain{
	TableSidecarNat: {
		baseChain(BasePrerouting, nft.ChainTypeNAT, nft.ChainHookPrerouting, nftPriorityDstNAT),
		baseChain(BaseOutput, nft.ChainTypeNAT, nft.ChainHookOutput, nftPriorityDstNAT),
		{Name: chainInbound}, {Name: chainRedirect}, {Name: chainInRedirect}, {Name: chainOutput}, {Name: chainOutputDNS},
	},
	TableSidecarMangle: {
		baseChain(BasePrerouting, nft.ChainTypeFilter, nft.ChainHookPrerouting, nftPriorityMangle),
		baseChain(BaseOutput, nft.ChainTypeRoute, nft.ChainHookOutput, nftPriorityMangle),
		{Name: chainDivert}, {Name: chainTProxy}, {Name: chainInbound}, {Name: chainDrop},
	},
	TableSidecarRaw: {
		baseChain(BasePrerouting, nft.ChainTypeFilter, nft.ChainHookPrerouting, nftPriorityRaw),
		baseChain(BaseOutput, nft.ChainTypeFilter, nft.ChainHookOutput, nftPriorityRaw),
		{Name: chainInbound}, {Name: chainOutputDNS},
	},
}

// nftList builds the rules of the sidecar tables the way Istio's nft
// builder orders them: appended, or inserted before a 0-based index (an
// index at or past the end, or into an empty chain, appends).
type nftList struct {
	rules map[string][]Rule // table -> rules in order of their chains
	anon  uint32            // last anonymous set id
}

func (l *nftList) chainRules(table, chain string) []int {
	var idx []int
	for i, r := range l.rules[table] {
		if r.Chain == chain {
			idx = append(idx, i)
		}
	}
	return idx
}

func (l *nftList) add(table, chain string, s ...statement) {
	l.rules[table] = append(l.rules[table], l.rule(chain, s))
}

func (l *nftList) insert(table, chain string, index int, s ...statement) {
	idx := l.chainRules(table, chain)
	if len(idx) == 0 || index >= len(idx) {
		l.add(table, chain, s...)
		return
	}
	l.rules[table] = slices.Insert(l.rules[table], idx[index], l.rule(chain, s))
}

// rule makes a rule, giving its anonymous sets ids unique in the rule set
// (so in any transaction it is written in).
func (l *nftList) rule(chain string, s []statement) Rule {
	r := Rule{Chain: chain, stmts: s}
	for i := range r.stmts {
		for j, e := range r.stmts[i].exprs {
			lk, ok := e.(*expr.Lookup)
			if !ok || lk.SetName != anonSetName {
				continue
			}
			l.anon++
			lk2 := *lk
			lk2.SetID = l.anon
			exprs := slices.Clone(r.stmts[i].exprs)
			exprs[j] = &lk2
			r.stmts[i].exprs = exprs
			a := r.stmts[i].anon
			a.id = l.anon
			r.anon = append(r.anon, a)
		}
	}
	return r
}

func (l *nftList) ruleSet() RuleSet {
	var rs RuleSet
	for _, name := range SidecarTables() {
		rules := l.rules[name]
		if len(rules) == 0 {
			continue
		}
		t := Table{Name: name}
		for _, c := range sidecarLayout[name] {
			if slices.ContainsFunc(rules, func(r Rule) bool { return r.Chain == c.Name }) {
				t.Chains = append(t.Chains, c)
			}
		}
		// Rules grouped by chain, in chain order (the kernel keeps one
		// list per chain; the order among chains is immaterial).
		for _, c := range t.Chains {
			for _, r := range rules {
				if r.Chain == c.Name {
					t.Rules = append(t.Rules, r)
				}
			}
		}
		rs.Tables = append(rs.Tables, t)
	}
	return rs
}

// BuildSidecarRules returns a pod's sidecar rules in Istio's native
// nftables layout: the same capture as xtables.BuildSidecarRules, one inet
// rule set for both families (the IPv6 matches only when the pod's IPv6 is
// captured), in the order Istio's builder leaves them.
func BuildSidecarRules(o rules.SidecarOptions) RuleSet {
	l := nftList{rules: map[string][]Rule{}}
	const nat, mangle, raw = TableSidecarNat, TableSidecarMangle, TableSidecarRaw
	lo4, lo6 := netip.PrefixFrom(netip.MustParseAddr("127.0.0.1"), 32), netip.PrefixFrom(netip.IPv6Loopback(), 128)
	v6 := o.IPv6
	tproxy := o.TProxy()

	for _, i := range o.ExcludeInterfaces {
		l.add(nat, BasePrerouting, ifname("iifname", false, i), counter(), verdict(expr.VerdictReturn))
		l.add(nat, BaseOutput, ifname("oifname", false, i), counter(), verdict(expr.VerdictReturn))
	}
	if tproxy {
		for _, i := range o.ExcludeInterfaces {
			l.add(mangle, BasePrerouting, ifname("iifname", false, i), counter(), verdict(expr.VerdictReturn))
			l.add(mangle, BaseOutput, ifname("oifname", false, i), counter(), verdict(expr.VerdictReturn))
		}
	}
	for _, i := range o.RerouteInterfaces {
		l.insert(nat, BasePrerouting, 0, ifname("iifname", false, i), counter(), verdict(expr.VerdictReturn))
	}
	if o.InvalidDrop {
		l.add(mangle, BasePrerouting, l4proto("tcp"), ctState(expr.CtStateBitINVALID), counter(), jump(chainDrop))
		l.add(mangle, chainDrop, counter(), verdict(expr.VerdictDrop))
	}
	l.add(nat, chainInbound, port("tcp", "dport", false, rules.SidecarTunnelPort), counter(), verdict(expr.VerdictReturn))
	l.add(nat, chainRedirect, l4proto("tcp"), counter(), redirect(rules.SidecarOutboundPort))
	l.add(nat, chainInRedirect, l4proto("tcp"), counter(), redirect(rules.SidecarInboundPort))

	// Inbound.
	switch {
	case !o.InboundCaptured():
	case tproxy:
		tmark := uint32(rules.SidecarTProxyMark)
		l.add(mangle, chainDivert, counter(), markSet(tmark))
		l.add(mangle, chainDivert, counter(), accept())
		l.add(mangle, chainTProxy, l4proto("tcp"), prefix("daddr", true, lo4), tproxyTo(rules.IPv4, rules.SidecarInboundPort), markSet(tmark), counter(), accept())
		if v6 {
			l.add(mangle, chainTProxy, l4proto("tcp"), prefix("daddr", true, lo6), tproxyTo(rules.IPv6, rules.SidecarInboundPort), markSet(tmark), counter(), accept())
		}
		l.add(mangle, BasePrerouting, l4proto("tcp"), counter(), jump(chainInbound))
		if o.IncludeAllInbound {
			for _, p := range o.ExcludeInboundPorts {
				l.add(mangle, chainInbound, port("tcp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
			}
			l.add(mangle, chainInbound, l4proto("tcp"), ctState(expr.CtStateBitRELATED|expr.CtStateBitESTABLISHED), counter(), jump(chainDivert))
			l.add(mangle, chainInbound, l4proto("tcp"), counter(), jump(chainTProxy))
		} else {
			for _, p := range o.IncludeInboundPorts {
				l.add(mangle, chainInbound, l4protoImplied("tcp"), ctState(expr.CtStateBitRELATED|expr.CtStateBitESTABLISHED),
					portOnly("tcp", "dport", false, p), counter(), jump(chainDivert))
				l.add(mangle, chainInbound, port("tcp", "dport", false, p), counter(), jump(chainTProxy))
			}
		}
	default:
		l.add(nat, BasePrerouting, l4proto("tcp"), counter(), jump(chainInbound))
		if o.IncludeAllInbound {
			for _, p := range o.ExcludeInboundPorts {
				l.add(nat, chainInbound, port("tcp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
			}
			l.add(nat, chainInbound, l4proto("tcp"), counter(), jump(chainInRedirect))
		} else {
			for _, p := range o.IncludeInboundPorts {
				l.add(nat, chainInbound, port("tcp", "dport", false, p), counter(), jump(chainInRedirect))
			}
		}
	}

	// Outbound.
	l.add(nat, BaseOutput, counter(), jump(chainOutput))
	for _, p := range o.ExcludeOutboundPorts {
		l.add(nat, chainOutput, port("tcp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
		l.add(nat, chainOutput, port("udp", "dport", false, p), counter(), verdict(expr.VerdictReturn))
	}
	l.add(nat, chainOutput, ifname("oifname", false, "lo"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv4)), counter(), verdict(expr.VerdictReturn))
	if v6 {
		l.add(nat, chainOutput, ifname("oifname", false, "lo"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv6)), counter(), verdict(expr.VerdictReturn))
	}
	owner := func(key expr.MetaKey, id uint32, dnsException bool) {
		tunnel := portOnly("tcp", "dport", true, rules.SidecarTunnelPort)
		if dnsException {
			tunnel = l.portSet("tcp", "dport", true, 53, rules.SidecarTunnelPort)
		}
		for _, lo := range []netip.Prefix{lo4, lo6} {
			if lo.Addr().Is6() && !v6 {
				continue
			}
			l.add(nat, chainOutput, ifname("oifname", false, "lo"), l4protoImplied("tcp"), prefix("daddr", true, lo), tunnel,
				skid(key, false, id), counter(), jump(chainInRedirect))
		}
		if !o.IncludesLoopback() {
			if o.DNS {
				l.add(nat, chainOutput, ifname("oifname", false, "lo"), l4protoImplied("tcp"), portOnly("tcp", "dport", true, 53),
					skid(key, true, id), counter(), verdict(expr.VerdictReturn))
			} else {
				l.add(nat, chainOutput, ifname("oifname", false, "lo"), skid(key, true, id), counter(), verdict(expr.VerdictReturn))
			}
		}
		l.add(nat, chainOutput, skid(key, false, id), counter(), verdict(expr.VerdictReturn))
	}
	owner(expr.MetaKeySKUID, o.ProxyUID, o.DNS)
	owner(expr.MetaKeySKGID, o.ProxyGID, false)
	if o.DNS {
		l.add(raw, BaseOutput, counter(), jump(chainOutputDNS))
		l.add(nat, chainOutput, counter(), jump(chainOutputDNS))
		l.add(nat, chainOutputDNS, port("tcp", "dport", false, 53), counter(), redirect(rules.SidecarDNSPort))
		l.add(nat, chainOutputDNS, port("udp", "dport", false, 53), counter(), redirect(rules.SidecarDNSPort))
		for _, id := range []struct {
			key expr.MetaKey
			v   uint32
		}{{expr.MetaKeySKUID, o.ProxyUID}, {expr.MetaKeySKGID, o.ProxyGID}} {
			l.add(raw, chainOutputDNS, port("udp", "dport", false, 53), skid(id.key, false, id.v), counter(), ctZone(1))
			l.add(raw, chainOutputDNS, port("udp", "sport", false, rules.SidecarDNSPort), skid(id.key, false, id.v), counter(), ctZone(2))
		}
		l.add(raw, BasePrerouting, counter(), jump(chainInbound))
		l.add(raw, chainOutputDNS, port("udp", "dport", false, 53), counter(), ctZone(2))
		l.add(raw, chainInbound, port("udp", "sport", false, 53), counter(), ctZone(1))
	}
	l.add(nat, chainOutput, prefix("daddr", false, lo4), counter(), verdict(expr.VerdictReturn))
	if v6 {
		l.add(nat, chainOutput, prefix("daddr", false, lo6), counter(), verdict(expr.VerdictReturn))
	}
	for _, f := range rules.Families(v6) {
		for _, c := range rules.OutboundCIDRs(o.ExcludeOutboundCIDRs, f) {
			l.add(nat, chainOutput, prefix("daddr", false, c), counter(), verdict(expr.VerdictReturn))
		}
	}
	for _, p := range o.IncludeOutboundPorts {
		l.add(nat, chainOutput, port("tcp", "dport", false, p), counter(), jump(chainRedirect))
	}
	if o.IncludeAllOutbound {
		l.add(nat, chainOutput, counter(), jump(chainRedirect))
		for _, i := range o.RerouteInterfaces {
			l.insert(nat, BasePrerouting, 0, ifname("iifname", false, i), counter(), jump(chainRedirect))
		}
	} else {
		for _, f := range rules.Families(v6) {
			for _, c := range rules.OutboundCIDRs(o.IncludeOutboundCIDRs, f) {
				for _, i := range o.RerouteInterfaces {
					l.insert(nat, BasePrerouting, 0, ifname("iifname", false, i), prefix("daddr", false, c), counter(), jump(chainRedirect))
				}
				l.add(nat, chainOutput, prefix("daddr", false, c), counter(), jump(chainRedirect))
			}
		}
	}

	if tproxy {
		tmark, omark := uint32(rules.SidecarTProxyMark), uint32(rules.SidecarOutboundMark)
		l.add(mangle, BasePrerouting, l4proto("tcp"), markIs(false, tmark), counter(), ctMarkSetMark())
		l.add(mangle, BaseOutput, ifname("oifname", false, "lo"), l4proto("tcp"), markIs(false, tmark), counter(), verdict(expr.VerdictReturn))
		for _, id := range []struct {
			key expr.MetaKey
			v   uint32
		}{{expr.MetaKeySKUID, o.ProxyUID}, {expr.MetaKeySKGID, o.ProxyGID}} {
			for _, lo := range []netip.Prefix{lo4, lo6} {
				if lo.Addr().Is6() && !v6 {
					continue
				}
				l.add(mangle, BaseOutput, ifname("oifname", false, "lo"), l4proto("tcp"), prefix("daddr", true, lo), skid(id.key, false, id.v), counter(), markSet(omark))
			}
		}
		l.add(mangle, BaseOutput, l4proto("tcp"), ctMarkIs(tmark), counter(), restoreMark())
		l.insert(mangle, chainInbound, 0, l4proto("tcp"), markIs(false, tmark), counter(), verdict(expr.VerdictReturn))
		l.insert(mangle, chainInbound, 1, ifname("iifname", false, "lo"), l4proto("tcp"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv4)), counter(), verdict(expr.VerdictReturn))
		if v6 {
			l.insert(mangle, chainInbound, 1, ifname("iifname", false, "lo"), l4proto("tcp"), addr("saddr", false, rules.SidecarInboundPassthrough(rules.IPv6)), counter(), verdict(expr.VerdictReturn))
		}
		l.insert(mangle, chainInbound, 2, ifname("iifname", false, "lo"), l4proto("tcp"), markIs(true, omark), counter(), verdict(expr.VerdictReturn))
	}
	return l.ruleSet()
}

// --- statements of the sidecar rules (see stmt.go) ---------------------

func verdict(k expr.VerdictKind) statement {
	names := map[expr.VerdictKind]string{expr.VerdictReturn: "return", expr.VerdictDrop: "drop", expr.VerdictAccept: "accept"}
	return stmt(names[k], &expr.Verdict{Kind: k})
}

// l4protoImplied is a protocol match nft does not print because a later
// port match implies it (and encodes it only once).
func l4protoImplied(proto string) statement { return statement{exprs: l4protoExprs(proto)} }

// portOnly is a port match after l4protoImplied: the payload compare alone.
func portOnly(proto, dir string, neq bool, p uint16) statement {
	full := port(proto, dir, neq, p)
	full.exprs = full.exprs[2:] // without the l4proto load and compare
	return full
}

// portSet matches a port against an anonymous set (`tcp dport != { 53,
// 15008 }`), after l4protoImplied; the set is created with the rule.
func (l *nftList) portSet(proto, dir string, neq bool, ports ...uint16) statement {
	off := uint32(0)
	if dir == "dport" {
		off = 2
	}
	texts := make([]string, len(ports))
	a := anonSet{keyed: nftSetType{magic: 13, len: 2}} // inet_service
	for i, p := range ports {
		texts[i] = strconv.Itoa(int(p))
		a.elems = append(a.elems, binaryutil.BigEndian.PutUint16(p))
	}
	_, t := opText(neq)
	return statement{
		text: fmt.Sprintf("%s %s %s{ %s }", proto, dir, t, strings.Join(texts, ", ")),
		exprs: []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2},
			&expr.Lookup{SourceRegister: 1, SetName: anonSetName, Invert: neq},
		},
		anon: a,
	}
}

// prefix matches an address prefix; a full-length one prints (and is
// encoded) as a plain address, a byte-aligned one loads only its bytes, any
// other one loads the address and masks it, as nft encodes them.
func prefix(dir string, neq bool, p netip.Prefix) statement {
	p = p.Masked()
	a := p.Addr()
	if p.Bits() == a.BitLen() {
		return addr(dir, neq, a)
	}
	f, ip, off := rules.IPv4, "ip", uint32(12)
	if a.Is6() {
		f, ip, off = rules.IPv6, "ip6", 8
	}
	if dir == "daddr" {
		off += uint32(a.BitLen() / 8)
	}
	op, t := opText(neq)
	ex := nfproto(f).exprs
	if p.Bits()%8 == 0 && p.Bits() > 0 {
		n := p.Bits() / 8
		ex = append(ex, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: uint32(n)},
			cmp(op, a.AsSlice()[:n]))
	} else {
		n := a.BitLen() / 8
		mask := netipMask(p.Bits(), a.BitLen())
		ex = append(ex, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: uint32(n)},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: uint32(n), Mask: mask, Xor: make([]byte, n)},
			cmp(op, a.AsSlice()))
	}
	return stmt(fmt.Sprintf("%s %s %s%s", ip, dir, t, p), ex...)
}

func netipMask(ones, bits int) []byte {
	m := make([]byte, bits/8)
	for i := range m {
		switch {
		case ones >= 8:
			m[i] = 0xff
			ones -= 8
		case ones > 0:
			m[i] = byte(0xff << (8 - ones))
			ones = 0
		}
	}
	return m
}

// skid matches the socket's owner uid (MetaKeySKUID) or gid.
func skid(key expr.MetaKey, neq bool, id uint32) statement {
	name := "skuid"
	if key == expr.MetaKeySKGID {
		name = "skgid"
	}
	op, t := opText(neq)
	return stmt(fmt.Sprintf("meta %s %s%d", name, t, id),
		&expr.Meta{Key: key, Register: 1},
		cmp(op, binaryutil.NativeEndian.PutUint32(id)))
}

// markIs matches the whole packet mark.
func markIs(neq bool, v uint32) statement {
	op, t := opText(neq)
	return stmt(fmt.Sprintf("meta mark %s%s", t, hex8(v)),
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		cmp(op, binaryutil.NativeEndian.PutUint32(v)))
}

// ctMarkIs matches the whole connection mark.
func ctMarkIs(v uint32) statement {
	return stmt("ct mark "+hex8(v),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		cmp(expr.CmpOpEq, binaryutil.NativeEndian.PutUint32(v)))
}

// markSet sets the packet mark.
func markSet(v uint32) statement {
	return stmt("meta mark set "+hex8(v),
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(v)},
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1, SourceRegister: true})
}

// ctMarkSetMark is CONNMARK --save-mark: the connection takes the packet's
// mark.
func ctMarkSetMark() statement {
	return stmt("ct mark set meta mark",
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true})
}

// ctState matches any of the conntrack states in bits.
func ctState(bits uint32) statement {
	var names []string
	for _, s := range []struct {
		bit  uint32
		name string
	}{{expr.CtStateBitINVALID, "invalid"}, {expr.CtStateBitESTABLISHED, "established"}, {expr.CtStateBitRELATED, "related"},
		{expr.CtStateBitNEW, "new"}, {expr.CtStateBitUNTRACKED, "untracked"}} {
		if bits&s.bit != 0 {
			names = append(names, s.name)
		}
	}
	return stmt("ct state "+strings.Join(names, ","),
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		maskBits(bits, 0),
		cmp(expr.CmpOpNeq, []byte{0, 0, 0, 0}))
}

// tproxyTo is TPROXY to the local port (the mark is set by the rule's next
// statement).
func tproxyTo(f rules.Family, p uint16) statement {
	fam, ip := byte(unix.NFPROTO_IPV4), "ip"
	if f == rules.IPv6 {
		fam, ip = unix.NFPROTO_IPV6, "ip6"
	}
	return stmt(fmt.Sprintf("tproxy %s to :%d", ip, p),
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
		&expr.TProxy{Family: fam, TableFamily: byte(inet), RegPort: 1})
}
