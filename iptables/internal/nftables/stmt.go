package nftables

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Statements: each constructor returns the text nft prints and the
// expressions that implement it.

func stmt(text string, exprs ...expr.Any) statement { return statement{text: text, exprs: exprs} }

func cmp(op expr.CmpOp, data []byte) *expr.Cmp {
	return &expr.Cmp{Op: op, Register: 1, Data: data}
}

func opText(neq bool) (expr.CmpOp, string) {
	if neq {
		return expr.CmpOpNeq, "!= "
	}
	return expr.CmpOpEq, ""
}

func counter() statement { return stmt("counter packets 0 bytes 0", &expr.Counter{}) }
func accept() statement  { return stmt("accept", &expr.Verdict{Kind: expr.VerdictAccept}) }
func jump(chain string) statement {
	return stmt("jump "+chain, &expr.Verdict{Kind: expr.VerdictJump, Chain: chain})
}

func nfproto(f rules.Family) statement {
	p, name := byte(unix.NFPROTO_IPV4), "ipv4"
	if f == rules.IPv6 {
		p, name = unix.NFPROTO_IPV6, "ipv6"
	}
	return stmt("meta nfproto "+name, &expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, cmp(expr.CmpOpEq, []byte{p}))
}

func l4proto(proto string) statement {
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
func addr(dir string, neq bool, a netip.Addr) statement {
	f, ip, off := rules.IPv4, "ip", uint32(12)
	if a.Is6() {
		f, ip, off = rules.IPv6, "ip6", 8
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
func port(proto, dir string, neq bool, p uint16) statement {
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

// mark matches the packet mark under rules.MarkMask.
func mark(neq bool, v uint32) statement {
	op, t := opText(neq)
	if !neq {
		t = "== "
	}
	return stmt(fmt.Sprintf("meta mark & %s %s%s", hex8(rules.MarkMask), t, hex8(v)),
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		maskBits(rules.MarkMask, 0),
		cmp(op, binaryutil.NativeEndian.PutUint32(v)))
}

// ctmark matches the connection mark under rules.MarkMask.
func ctmark(v uint32) statement {
	return stmt(fmt.Sprintf("ct mark & %s == %s", hex8(rules.MarkMask), hex8(v)),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		maskBits(rules.MarkMask, 0),
		cmp(expr.CmpOpEq, binaryutil.NativeEndian.PutUint32(v)))
}

func maskBits(mask, xor uint32) *expr.Bitwise {
	return &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
		Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: binaryutil.NativeEndian.PutUint32(xor)}
}

func ifname(dir string, neq bool, name string) statement {
	key := expr.MetaKeyIIFNAME
	if dir == "oifname" {
		key = expr.MetaKeyOIFNAME
	}
	op, t := opText(neq)
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return stmt(fmt.Sprintf("%s %s%q", dir, t, name), &expr.Meta{Key: key, Register: 1}, cmp(op, b))
}

func redirect(p uint16) statement {
	return stmt(fmt.Sprintf("redirect to :%d", p),
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
		// As the kernel reads it back: max = min, port range given.
		&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})
}

// setConnmark is CONNMARK --set-xmark rules.ConnMark/rules.MarkMask.
func setConnmark() statement {
	keep := ^uint32(rules.MarkMask)
	// nft prints (x & keep) ^ 0x111 as "& (keep|0x111) | 0x111".
	return stmt(fmt.Sprintf("ct mark set ct mark & %s | %s", hex8(keep|rules.ConnMark), hex8(rules.ConnMark)),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		maskBits(keep, rules.ConnMark),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true})
}

// restoreMark is CONNMARK --restore-mark with full masks.
func restoreMark() statement {
	return stmt("meta mark set ct mark",
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1, SourceRegister: true})
}

func ctZone(z uint16) statement {
	return stmt(fmt.Sprintf("ct zone set %d", z),
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint16(z)},
		&expr.Ct{Key: expr.CtKeyZONE, Register: 1, SourceRegister: true})
}

func skuid(uid uint32) statement {
	return stmt(fmt.Sprintf("meta skuid %d", uid),
		&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
		cmp(expr.CmpOpEq, binaryutil.NativeEndian.PutUint32(uid)))
}

func inSet(f rules.Family, set string) statement {
	ip, off, n := "ip", uint32(16), uint32(4)
	if f == rules.IPv6 {
		ip, off, n = "ip6", 24, 16
	}
	return stmt(fmt.Sprintf("%s daddr @%s", ip, set), append(nfproto(f).exprs,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
		&expr.Lookup{SourceRegister: 1, SetName: set})...)
}

func snatTo(a netip.Addr) statement {
	fam, ip := uint32(unix.NFPROTO_IPV4), "ip"
	if a.Is6() {
		fam, ip = unix.NFPROTO_IPV6, "ip6"
	}
	return stmt(fmt.Sprintf("snat %s to %s", ip, a),
		&expr.Immediate{Register: 1, Data: a.AsSlice()},
		&expr.NAT{Type: expr.NATTypeSourceNAT, Family: fam, RegAddrMin: 1, RegAddrMax: 1}) // max = min, as read back
}

func hex8(v uint32) string { return fmt.Sprintf("0x%08x", v) }
