package iptables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Native nftables layout, Istio's (1.28+) so pods and nodes it enrolled in
// nft mode are adopted: inet tables istio-ambient-{nat,mangle,raw}, base
// chains prerouting/output (postrouting on the node), regular chains
// istio-prerouting/istio-output, probe sets in the nat table.
const (
	NFTTableNat    = "istio-ambient-nat"
	NFTTableMangle = "istio-ambient-mangle"
	NFTTableRaw    = "istio-ambient-raw"

	nftChainPrerouting  = "istio-prerouting"
	nftChainOutput      = "istio-output"
	nftBasePrerouting   = "prerouting"
	nftBaseOutput       = "output"
	nftBasePostrouting  = "postrouting"
	probeSetComment     = "pod IPs whose kubelet probes are SNATed to the probe address"
	nftPriorityDstNAT   = -100
	nftPriorityMangle   = -150
	nftPriorityRaw      = -300
	nftPrioritySrcNAT   = 100
	nftPolicyAcceptText = "policy accept;"
)

// nftStmt is one statement of a rule: the text nft prints for it and the
// expressions that implement it. Both come from the same constructor, so the
// golden text and what is programmed cannot drift apart.
type nftStmt struct {
	text  string
	exprs []expr.Any
}

// NFTRule is one rule of a chain.
type NFTRule struct {
	Chain string
	stmts []nftStmt
	key   string // the expressions' encoding, filled by withKeys
}

// Text is the rule as `nft list` prints it (counters at zero).
func (r NFTRule) Text() string {
	parts := make([]string, len(r.stmts))
	for i, s := range r.stmts {
		parts[i] = s.text
	}
	return strings.Join(parts, " ")
}

func (r NFTRule) exprs() []expr.Any {
	var out []expr.Any
	for _, s := range r.stmts {
		out = append(out, s.exprs...)
	}
	return out
}

// NFTChain is a chain; base chains have a hook.
type NFTChain struct {
	Name     string
	Type     nftables.ChainType // "" for a regular chain
	Hook     *nftables.ChainHook
	Priority int32
}

func (c NFTChain) base() bool { return c.Hook != nil }

// NFTSet is a named set of addresses (the probe sets).
type NFTSet struct {
	Name string
	V6   bool
}

// NFTTable is one inet table: its sets, chains (in creation order) and rules
// (in order; a chain's rules are those naming it).
type NFTTable struct {
	Name   string
	Sets   []NFTSet
	Chains []NFTChain
	Rules  []NFTRule
}

// NFTRuleSet is a complete set of our nftables tables. Like RuleSet it is
// data: render it, compare it, apply it.
type NFTRuleSet struct {
	Tables []NFTTable
}

func (rs NFTRuleSet) hasSets() bool {
	return slices.ContainsFunc(rs.Tables, func(t NFTTable) bool { return len(t.Sets) > 0 })
}

// TableNames lists the set's tables.
func (rs NFTRuleSet) TableNames() []string {
	out := make([]string, len(rs.Tables))
	for i, t := range rs.Tables {
		out[i] = t.Name
	}
	return out
}

// --- statements ---------------------------------------------------------

func stmt(text string, exprs ...expr.Any) nftStmt { return nftStmt{text: text, exprs: exprs} }

func cmp(op expr.CmpOp, data []byte) *expr.Cmp {
	return &expr.Cmp{Op: op, Register: 1, Data: data}
}

func opText(neq bool) (expr.CmpOp, string) {
	if neq {
		return expr.CmpOpNeq, "!= "
	}
	return expr.CmpOpEq, ""
}

func counter() nftStmt { return stmt("counter packets 0 bytes 0", &expr.Counter{}) }
func accept() nftStmt  { return stmt("accept", &expr.Verdict{Kind: expr.VerdictAccept}) }
func jump(chain string) nftStmt {
	return stmt("jump "+chain, &expr.Verdict{Kind: expr.VerdictJump, Chain: chain})
}

func nfproto(f Family) nftStmt {
	p, name := byte(unix.NFPROTO_IPV4), "ipv4"
	if f == IPv6 {
		p, name = unix.NFPROTO_IPV6, "ipv6"
	}
	return stmt("meta nfproto "+name, &expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, cmp(expr.CmpOpEq, []byte{p}))
}

func l4proto(proto string) nftStmt {
	return stmt("meta l4proto "+proto, l4protoExprs(proto)...)
}

func l4protoExprs(proto string) []expr.Any {
	p := byte(unix.IPPROTO_TCP)
	if proto == "udp" {
		p = unix.IPPROTO_UDP
	}
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, cmp(expr.CmpOpEq, []byte{p})}
}

// addr matches the source or destination address (dir "saddr"/"daddr"). In an
// inet table it first pins the family, as nft does implicitly.
func addr(dir string, neq bool, a netip.Addr) nftStmt {
	f, ip, off := IPv4, "ip", uint32(12)
	if a.Is6() {
		f, ip, off = IPv6, "ip6", 8
	}
	if dir == "daddr" {
		off += uint32(a.BitLen() / 8)
	}
	op, t := opText(neq)
	ex := append(nfproto(f).exprs,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: uint32(a.BitLen() / 8)},
		cmp(op, a.AsSlice()))
	return stmt(fmt.Sprintf("%s %s %s%s", ip, dir, t, a), ex...)
}

// port matches a transport port ("sport"/"dport") of tcp or udp.
func port(proto, dir string, neq bool, p uint16) nftStmt {
	off := uint32(0)
	if dir == "dport" {
		off = 2
	}
	op, t := opText(neq)
	ex := append(l4protoExprs(proto),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2},
		cmp(op, binaryutil.BigEndian.PutUint16(p)))
	return stmt(fmt.Sprintf("%s %s %s%d", proto, dir, t, p), ex...)
}

// mark matches the packet mark under MarkMask.
func mark(neq bool, v uint32) nftStmt {
	op, t := opText(neq)
	if !neq {
		t = "== "
	}
	return stmt(fmt.Sprintf("meta mark & %s %s%s", hex8(MarkMask), t, hex8(v)),
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		maskBits(MarkMask, 0),
		cmp(op, binaryutil.NativeEndian.PutUint32(v)))
}

// ctmark matches the connection mark under MarkMask.
func ctmark(v uint32) nftStmt {
	return stmt(fmt.Sprintf("ct mark & %s == %s", hex8(MarkMask), hex8(v)),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		maskBits(MarkMask, 0),
		cmp(expr.CmpOpEq, binaryutil.NativeEndian.PutUint32(v)))
}

func maskBits(mask, xor uint32) *expr.Bitwise {
	return &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
		Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: binaryutil.NativeEndian.PutUint32(xor)}
}

func ifname(dir string, neq bool, name string) nftStmt {
	key := expr.MetaKeyIIFNAME
	if dir == "oifname" {
		key = expr.MetaKeyOIFNAME
	}
	op, t := opText(neq)
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return stmt(fmt.Sprintf("%s %s%q", dir, t, name), &expr.Meta{Key: key, Register: 1}, cmp(op, b))
}

func redirect(p uint16) nftStmt {
	return stmt(fmt.Sprintf("redirect to :%d", p),
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
		// As the kernel reads it back: max = min, port range given.
		&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})
}

// setConnmark is CONNMARK --set-xmark ConnMark/MarkMask.
func setConnmark() nftStmt {
	keep := ^uint32(MarkMask)
	// nft prints (x & keep) ^ 0x111 as "& (keep|0x111) | 0x111".
	return stmt(fmt.Sprintf("ct mark set ct mark & %s | %s", hex8(keep|ConnMark), hex8(ConnMark)),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		maskBits(keep, ConnMark),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true})
}

// restoreMark is CONNMARK --restore-mark with full masks.
func restoreMark() nftStmt {
	return stmt("meta mark set ct mark",
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1, SourceRegister: true})
}

func ctZone(z uint16) nftStmt {
	return stmt(fmt.Sprintf("ct zone set %d", z),
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint16(z)},
		&expr.Ct{Key: expr.CtKeyZONE, Register: 1, SourceRegister: true})
}

func skuid(uid uint32) nftStmt {
	return stmt(fmt.Sprintf("meta skuid %d", uid),
		&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
		cmp(expr.CmpOpEq, binaryutil.NativeEndian.PutUint32(uid)))
}

func inSet(f Family, set string) nftStmt {
	ip, off, n := "ip", uint32(16), uint32(4)
	if f == IPv6 {
		ip, off, n = "ip6", 24, 16
	}
	return stmt(fmt.Sprintf("%s daddr @%s", ip, set), append(nfproto(f).exprs,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
		&expr.Lookup{SourceRegister: 1, SetName: set})...)
}

func snatTo(a netip.Addr) nftStmt {
	fam, ip := uint32(unix.NFPROTO_IPV4), "ip"
	if a.Is6() {
		fam, ip = unix.NFPROTO_IPV6, "ip6"
	}
	return stmt(fmt.Sprintf("snat %s to %s", ip, a),
		&expr.Immediate{Register: 1, Data: a.AsSlice()},
		&expr.NAT{Type: expr.NATTypeSourceNAT, Family: fam, RegAddrMin: 1, RegAddrMax: 1}) // max = min, as read back
}

func hex8(v uint32) string { return fmt.Sprintf("0x%08x", v) }

// --- rule sets ----------------------------------------------------------

func podTable(name string, prerouting, output NFTChain) NFTTable {
	return NFTTable{
		Name: name,
		Chains: []NFTChain{prerouting, output,
			{Name: nftChainPrerouting}, {Name: nftChainOutput}},
		Rules: []NFTRule{
			{Chain: nftBasePrerouting, stmts: []nftStmt{jump(nftChainPrerouting)}},
			{Chain: nftBaseOutput, stmts: []nftStmt{jump(nftChainOutput)}},
		},
	}
}

func baseChain(name string, typ nftables.ChainType, hook *nftables.ChainHook, prio int32) NFTChain {
	return NFTChain{Name: name, Type: typ, Hook: hook, Priority: prio}
}

// BuildPodRulesNFT returns the in-pod rule set for the nftables backend: the
// same capture as BuildPodRules, in Istio's native-nftables layout. One inet
// table covers both families; rules that match no address apply to both and,
// with IPv6 off, are pinned to IPv4 so IPv6 stays uncaptured exactly as with
// the iptables backends. All three tables always exist (raw's chains stay
// empty without DNS capture), so delete needs no options.
func BuildPodRulesNFT(cfg Config, opts PodOptions) NFTRuleSet {
	fams := []Family{IPv4}
	if cfg.IPv6 {
		fams = append(fams, IPv6)
	}
	// agnostic prefixes a family-agnostic rule: nothing with IPv6 on, IPv4 only
	// with IPv6 off.
	agnostic := func(s ...nftStmt) []nftStmt {
		if !cfg.IPv6 {
			s = append([]nftStmt{nfproto(IPv4)}, s...)
		}
		return s
	}
	lo := func(f Family) netip.Addr {
		if f == IPv6 {
			return netip.IPv6Loopback()
		}
		return netip.MustParseAddr("127.0.0.1")
	}

	nat := podTable(NFTTableNat,
		baseChain(nftBasePrerouting, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, nftPriorityDstNAT),
		baseChain(nftBaseOutput, nftables.ChainTypeNAT, nftables.ChainHookOutput, nftPriorityDstNAT))
	mangle := podTable(NFTTableMangle,
		baseChain(nftBasePrerouting, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftPriorityMangle),
		// route type: a mark restored here re-routes the packet (policy route).
		baseChain(nftBaseOutput, nftables.ChainTypeRoute, nftables.ChainHookOutput, nftPriorityMangle))
	raw := podTable(NFTTableRaw,
		baseChain(nftBasePrerouting, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftPriorityRaw),
		baseChain(nftBaseOutput, nftables.ChainTypeFilter, nftables.ChainHookOutput, nftPriorityRaw))

	add := func(t *NFTTable, chain string, s ...nftStmt) {
		// Every rule counts, as Istio's do: `nft list` shows what matched.
		s = append(s[:len(s)-1:len(s)-1], counter(), s[len(s)-1])
		t.Rules = append(t.Rules, NFTRule{Chain: chain, stmts: s})
	}

	add(&mangle, nftChainPrerouting, agnostic(mark(false, ProxyMark), setConnmark())...)
	add(&mangle, nftChainOutput, agnostic(ctmark(ConnMark), restoreMark())...)

	for _, iface := range rerouteInterfaces(cfg, opts) {
		add(&nat, nftChainPrerouting, agnostic(ifname("iifname", false, iface), l4proto("tcp"), redirect(OutboundPort))...)
	}
	if !opts.BypassInbound {
		for _, f := range fams {
			add(&nat, nftChainPrerouting, l4proto("tcp"), addr("saddr", false, f.probeSNAT()), accept())
		}
		for _, f := range fams {
			add(&nat, nftChainPrerouting, addr("daddr", true, lo(f)), port("tcp", "dport", true, HBONEPort),
				mark(true, ProxyMark), redirect(InboundPort))
		}
	}
	for _, f := range fams {
		add(&nat, nftChainOutput, l4proto("tcp"), addr("daddr", false, f.probeSNAT()), accept())
	}
	if opts.DNSCapture {
		add(&nat, nftChainOutput, agnostic(ifname("oifname", true, "lo"), mark(true, ProxyMark), port("udp", "dport", false, 53), redirect(DNSPort))...)
		for _, f := range fams {
			add(&nat, nftChainOutput, addr("daddr", true, lo(f)), port("tcp", "dport", false, 53), mark(true, ProxyMark), redirect(DNSPort))
		}
	}
	add(&nat, nftChainOutput, agnostic(l4proto("tcp"), mark(false, ConnMark), accept())...)
	for _, f := range fams {
		add(&nat, nftChainOutput, ifname("oifname", false, "lo"), addr("daddr", true, lo(f)), accept())
	}
	for _, f := range fams {
		add(&nat, nftChainOutput, l4proto("tcp"), addr("daddr", true, lo(f)), mark(true, ProxyMark), redirect(OutboundPort))
	}

	if opts.DNSCapture {
		add(&raw, nftChainPrerouting, agnostic(port("udp", "sport", false, 53), mark(true, ProxyMark), ctZone(1))...)
		add(&raw, nftChainOutput, agnostic(port("udp", "dport", false, 53), mark(false, ProxyMark), ctZone(1))...)
	}
	return NFTRuleSet{Tables: []NFTTable{nat, mangle, raw}}
}

// BuildHostRulesNFT returns the node's probe SNAT rules for the nftables
// backend, as Istio keys them: TCP from the kubelet's uid to an address in
// the probe set leaves with the probe source address.
func BuildHostRulesNFT(cfg Config, kubeletUID uint32) NFTRuleSet {
	t := NFTTable{
		Name:   NFTTableNat,
		Chains: []NFTChain{baseChain(nftBasePostrouting, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, nftPrioritySrcNAT)},
	}
	fams := []Family{IPv4}
	if cfg.IPv6 {
		fams = append(fams, IPv6)
	}
	for _, f := range fams {
		t.Sets = append(t.Sets, NFTSet{Name: f.probeSet(), V6: f == IPv6})
	}
	for _, f := range fams {
		t.Rules = append(t.Rules, NFTRule{Chain: nftBasePostrouting, stmts: []nftStmt{
			l4proto("tcp"), skuid(kubeletUID), inSet(f, f.probeSet()), counter(), snatTo(f.probeSNAT()),
		}})
	}
	return NFTRuleSet{Tables: []NFTTable{t}}
}

// --- rendering ----------------------------------------------------------

var hookNames = map[nftables.ChainHook]string{
	*nftables.ChainHookPrerouting:  "prerouting",
	*nftables.ChainHookOutput:      "output",
	*nftables.ChainHookPostrouting: "postrouting",
}

// priorityText prints a base chain's priority the way nft does for the
// standard values of its family and type.
func priorityText(c NFTChain) string {
	names := map[int32]string{nftPriorityRaw: "raw", nftPriorityMangle: "mangle", 0: "filter"}
	switch *c.Hook {
	case *nftables.ChainHookPrerouting:
		names[nftPriorityDstNAT] = "dstnat"
	case *nftables.ChainHookPostrouting:
		names[nftPrioritySrcNAT] = "srcnat"
	}
	if n, ok := names[c.Priority]; ok {
		return n
	}
	return strconv.Itoa(int(c.Priority))
}

// Render returns the set as `nft list table` prints it (one table after
// another, counters at zero, sets without elements).
func (rs NFTRuleSet) Render() string {
	var b strings.Builder
	for _, t := range rs.Tables {
		b.WriteString(t.render())
	}
	return b.String()
}

func (t NFTTable) render() string {
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
