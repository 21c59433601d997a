package nftables

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

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
