package nftables

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	nft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The transport of the pod's critical path: one NETLINK_NETFILTER socket
// per operation, plain blocking syscalls on the calling thread, one
// sendmsg per transaction. The library's connection (still used for the
// probe-set elements) costs ~1 ms more per pod transaction in a pod's
// namespace: every send and receive of mdlayher/netlink starts a goroutine
// to watch for cancellation, which on the thread locked into the pod's
// namespace means two OS-thread hand-offs per syscall; it asks an ack of
// every message and an echo of every rule, ~80 receives per apply. Here
// only the last message of a transaction asks for an ack: the kernel
// processes a batch inside the sendmsg and queues every error, and that
// ack, before sendmsg returns (nft itself reads them the same way).
//
// Messages are encoded with mdlayher/netlink's attribute encoder and the
// library's expression encoding (expr.Marshal), the same bytes the library
// sends, so what verify compares and what apply writes stay one encoding.

// recvTimeout bounds every receive: a namespace whose nf_tables does not
// answer fails the operation instead of hanging it.
const recvTimeout = 10 * time.Second

// conn is one netlink socket of the namespace the calling thread was in
// when it was opened; it stays bound to that namespace whichever thread
// uses it.
type conn struct {
	fd  int
	seq uint32
	buf []byte
	// closing counts the release in the background (see close).
	closing *sync.WaitGroup
}

// dial opens a socket in the calling thread's network namespace.
func dial(closing *sync.WaitGroup) (*conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	tv := unix.NsecToTimeval(recvTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink receive timeout: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink bind: %w", err)
	}
	return &conn{fd: fd, buf: make([]byte, 64*1024), closing: closing}, nil
}

// close releases the socket in the background (synchronously when no
// WaitGroup counts it): the kernel makes the
// release of any nftables socket wait while objects deleted by a committed
// transaction (ours or another pod's) await destruction after an RCU grace
// period — several ms on the pod's critical path for nothing, since the
// transaction is already committed. Bounded: a release returns after the
// grace period.
func (c *conn) close() {
	fd := c.fd
	if c.closing == nil {
		_ = unix.Close(fd)
		return
	}
	c.closing.Add(1)
	go func() {
		defer c.closing.Done()
		_ = unix.Close(fd)
	}()
}

func (c *conn) nextSeq() uint32 {
	c.seq++
	return c.seq
}

// header is nlmsghdr plus nfgenmsg.
func header(b []byte, typ uint16, flags uint16, seq uint32, family uint8, resID uint16) []byte {
	b = binary.NativeEndian.AppendUint32(b, 0) // length, set by finish
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = binary.NativeEndian.AppendUint16(b, flags)
	b = binary.NativeEndian.AppendUint32(b, seq)
	b = binary.NativeEndian.AppendUint32(b, 0) // port id: the kernel's
	return append(b, family, unix.NFNETLINK_V0, byte(resID>>8), byte(resID))
}

// finish sets the length of the message that starts at start and pads it.
func finish(b []byte, start int) []byte {
	binary.NativeEndian.PutUint32(b[start:], uint32(len(b)-start))
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func msgType(t int) uint16 { return uint16(unix.NFNL_SUBSYS_NFTABLES<<8 | t) }

// send writes b to the kernel.
func (c *conn) send(b []byte) error {
	for {
		err := unix.Sendto(c.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		if err != unix.EINTR {
			return err
		}
	}
}

// receive reads one datagram and returns its messages. flags are the recv
// flags (MSG_DONTWAIT to drain).
func (c *conn) receive(flags int) ([]mnl.Message, error) {
	n, _, rflags, _, err := unix.Recvmsg(c.fd, c.buf, nil, flags)
	for err == unix.EINTR {
		// A signal (a child's SIGCHLD, say) interrupts a receive on a
		// socket with a timeout instead of restarting it.
		n, _, rflags, _, err = unix.Recvmsg(c.fd, c.buf, nil, flags)
	}
	if err == unix.EAGAIN && flags&unix.MSG_DONTWAIT == 0 {
		return nil, fmt.Errorf("no answer from the kernel within %s: %w", recvTimeout, err)
	}
	if err != nil {
		return nil, err
	}
	if rflags&unix.MSG_TRUNC != 0 {
		return nil, errors.New("netlink message truncated")
	}
	var out []mnl.Message
	for b := c.buf[:n]; len(b) >= unix.NLMSG_HDRLEN; {
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return nil, fmt.Errorf("netlink message of length %d in %d bytes", l, len(b))
		}
		var m mnl.Message
		if err := m.UnmarshalBinary(b[:l]); err != nil {
			return nil, err
		}
		// Copied: the buffer is reused by the next receive.
		m.Data = append([]byte(nil), m.Data...)
		out = append(out, m)
		b = b[min(len(b), (l+3)&^3):]
	}
	return out, nil
}

// errnoOf returns the error an NLMSG_ERROR message carries (nil for an ack).
func errnoOf(m mnl.Message) error {
	if len(m.Data) < 4 {
		return errors.New("short netlink error message")
	}
	if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
		return unix.Errno(-e)
	}
	return nil
}

// dump sends a dump request of type t for family (attrs, if any, filter it)
// and calls fn with the family and attributes of every message until the
// dump is done.
func (c *conn) dump(t int, family uint8, attrs []byte, fn func(family uint8, attrs []byte) error) error {
	seq := c.nextSeq()
	b := header(nil, msgType(t), unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq, family, 0)
	b = finish(append(b, attrs...), 0)
	if err := c.send(b); err != nil {
		return err
	}
	for {
		msgs, err := c.receive(0)
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Sequence != seq {
				continue
			}
			switch m.Header.Type {
			case mnl.Done:
				return nil
			case mnl.Error:
				if err := errnoOf(m); err != nil {
					return err
				}
				return nil
			}
			if len(m.Data) < 4 {
				continue
			}
			if err := fn(m.Data[0], m.Data[4:]); err != nil {
				return err
			}
		}
	}
}

// tx is one transaction: the messages between a batch begin and end, which
// the kernel commits atomically or not at all.
type tx struct {
	b []byte
	// lastAt is where the last message starts.
	lastAt int
	seqs   []uint32
	what   []string // a description of each message, for errors
	c      *conn
	err    error
}

func (c *conn) begin() *tx {
	t := &tx{c: c}
	t.b = finish(header(nil, unix.NFNL_MSG_BATCH_BEGIN, unix.NLM_F_REQUEST, c.nextSeq(), unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES), 0)
	return t
}

// add appends one message of type t for our inet tables.
func (t *tx) add(typ int, flags uint16, what string, encode func(ae *mnl.AttributeEncoder)) {
	if t.err != nil {
		return
	}
	ae := mnl.NewAttributeEncoder()
	ae.ByteOrder = binary.BigEndian
	encode(ae)
	attrs, err := ae.Encode()
	if err != nil {
		t.err = fmt.Errorf("encoding %s: %w", what, err)
		return
	}
	seq := t.c.nextSeq()
	start := len(t.b)
	t.lastAt = start
	t.b = header(t.b, msgType(typ), unix.NLM_F_REQUEST|flags, seq, unix.NFPROTO_INET, 0)
	t.b = finish(append(t.b, attrs...), start)
	t.seqs, t.what = append(t.seqs, seq), append(t.what, what)
}

func (t *tx) addTable(name string) {
	t.add(unix.NFT_MSG_NEWTABLE, unix.NLM_F_CREATE, "add table "+name, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_TABLE_NAME, name)
		ae.Uint32(unix.NFTA_TABLE_FLAGS, 0)
	})
}

func (t *tx) delTable(name string) {
	t.add(unix.NFT_MSG_DELTABLE, 0, "delete table "+name, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_TABLE_NAME, name)
		ae.Uint32(unix.NFTA_TABLE_FLAGS, 0)
	})
}

func (t *tx) addChain(table string, ch Chain) {
	t.add(unix.NFT_MSG_NEWCHAIN, unix.NLM_F_CREATE, "add chain "+table+" "+ch.Name, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_CHAIN_TABLE, table)
		ae.String(unix.NFTA_CHAIN_NAME, ch.Name)
		if ch.base() {
			ae.Nested(unix.NFTA_CHAIN_HOOK, func(h *mnl.AttributeEncoder) error {
				h.Uint32(unix.NFTA_HOOK_HOOKNUM, uint32(*ch.Hook))
				h.Uint32(unix.NFTA_HOOK_PRIORITY, uint32(ch.Priority))
				return nil
			})
			ae.Uint32(unix.NFTA_CHAIN_POLICY, uint32(nft.ChainPolicyAccept))
			ae.String(unix.NFTA_CHAIN_TYPE, string(ch.Type))
		}
	})
}

// flushChain deletes every rule of the chain.
func (t *tx) flushChain(table, chain string) {
	t.add(unix.NFT_MSG_DELRULE, 0, "flush chain "+table+" "+chain, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_RULE_TABLE, table)
		ae.String(unix.NFTA_RULE_CHAIN, chain)
	})
}

func (t *tx) delChain(table, chain string) {
	t.add(unix.NFT_MSG_DELCHAIN, 0, "delete chain "+table+" "+chain, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_CHAIN_TABLE, table)
		ae.String(unix.NFTA_CHAIN_NAME, chain)
	})
}

// addRule appends the rule to its chain.
func (t *tx) addRule(table string, r Rule) {
	enc := r.enc
	if enc == nil {
		var err error
		if enc, err = encodeExprs(r.exprs()); err != nil {
			t.err = err
			return
		}
	}
	t.add(unix.NFT_MSG_NEWRULE, unix.NLM_F_CREATE|unix.NLM_F_APPEND, "add rule "+table+" "+r.Chain+": "+r.Text(), func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_RULE_TABLE, table)
		ae.String(unix.NFTA_RULE_CHAIN, r.Chain)
		ae.Bytes(unix.NLA_F_NESTED|unix.NFTA_RULE_EXPRESSIONS, enc)
	})
}

// encodeExprs is a rule's expression list as the kernel takes it.
func encodeExprs(exprs []expr.Any) ([]byte, error) {
	ae := mnl.NewAttributeEncoder()
	for _, e := range exprs {
		b, err := expr.Marshal(byte(inet), e)
		if err != nil {
			return nil, fmt.Errorf("encoding %T: %w", e, err)
		}
		ae.Bytes(unix.NLA_F_NESTED|unix.NFTA_LIST_ELEM, b)
	}
	return ae.Encode()
}

// addSet adds a probe set (a plain set of addresses with a comment, as nft
// creates it); id names it within the transaction.
func (t *tx) addSet(table string, s Set, id uint32) {
	typ := nft.TypeIPAddr
	if s.V6 {
		typ = nft.TypeIP6Addr
	}
	t.add(unix.NFT_MSG_NEWSET, unix.NLM_F_CREATE, "add set "+table+" "+s.Name, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_SET_TABLE, table)
		ae.String(unix.NFTA_SET_NAME, s.Name)
		ae.Uint32(unix.NFTA_SET_FLAGS, 0)
		ae.Uint32(unix.NFTA_SET_KEY_TYPE, typ.GetNFTMagic())
		ae.Uint32(unix.NFTA_SET_KEY_LEN, typ.Bytes)
		ae.Uint32(unix.NFTA_SET_ID, id)
		ae.Bytes(unix.NFTA_SET_USERDATA, userdata.AppendString(nil, userdata.NFTNL_UDATA_SET_COMMENT, probeSetComment))
	})
}

// commit sends the transaction in one sendmsg, the last message asking for
// an ack, and reads what the kernel queued while processing it: the first
// error, naming the message it refused, or nil once the ack is there.
func (t *tx) commit() error {
	if t.err != nil {
		return t.err
	}
	if len(t.seqs) == 0 {
		return nil
	}
	last := t.seqs[len(t.seqs)-1]
	// Only the last message asks for an ack (nlmsg_flags at offset 6).
	flags := t.b[t.lastAt+6:]
	binary.NativeEndian.PutUint16(flags, binary.NativeEndian.Uint16(flags)|unix.NLM_F_ACK)
	b := finish(header(t.b, unix.NFNL_MSG_BATCH_END, unix.NLM_F_REQUEST, t.c.nextSeq(), unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES), len(t.b))
	if err := t.c.send(b); err != nil {
		return fmt.Errorf("sending the transaction: %w", err)
	}
	acked := false
	var first error
	for {
		msgs, err := t.c.receive(unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EAGAIN) {
			break
		}
		if err != nil {
			return fmt.Errorf("reading the transaction's result: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Type != mnl.Error {
				continue
			}
			if err := errnoOf(m); err != nil {
				if first == nil {
					first = fmt.Errorf("%s: %w", t.describe(m.Header.Sequence), err)
				}
			} else if m.Header.Sequence == last {
				acked = true
			}
		}
	}
	switch {
	case first != nil:
		return first
	case !acked:
		return errors.New("the kernel did not acknowledge the transaction")
	}
	return nil
}

func (t *tx) describe(seq uint32) string {
	for i, s := range t.seqs {
		if s == seq {
			return t.what[i]
		}
	}
	return "transaction"
}

// --- reading ------------------------------------------------------------

// chainInfo is a chain as listed: family, table, name and, for a base
// chain, its hook, priority and type.
type chainInfo struct {
	family uint8
	table  string
	name   string
	hook   *uint32
	prio   int32
	typ    string
}

// listChains lists the chains of family (NFPROTO_UNSPEC: every family).
func (c *conn) listChains(family uint8) ([]chainInfo, error) {
	var out []chainInfo
	err := c.dump(unix.NFT_MSG_GETCHAIN, family, nil, func(fam uint8, attrs []byte) error {
		ch := chainInfo{family: fam}
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_CHAIN_TABLE:
				ch.table = ad.String()
			case unix.NFTA_CHAIN_NAME:
				ch.name = ad.String()
			case unix.NFTA_CHAIN_TYPE:
				ch.typ = ad.String()
			case unix.NFTA_CHAIN_HOOK:
				ad.Nested(func(h *mnl.AttributeDecoder) error {
					for h.Next() {
						switch h.Type() {
						case unix.NFTA_HOOK_HOOKNUM:
							n := h.Uint32()
							ch.hook = &n
						case unix.NFTA_HOOK_PRIORITY:
							ch.prio = int32(h.Uint32())
						}
					}
					return nil
				})
			}
		}
		if err := ad.Err(); err != nil {
			return err
		}
		out = append(out, ch)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing nftables chains: %w", err)
	}
	return out, nil
}

// listTables lists the names of the inet tables.
func (c *conn) listTables() ([]string, error) {
	var out []string
	err := c.dump(unix.NFT_MSG_GETTABLE, unix.NFPROTO_INET, nil, func(_ uint8, attrs []byte) error {
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		for ad.Next() {
			if ad.Type() == unix.NFTA_TABLE_NAME {
				out = append(out, ad.String())
			}
		}
		return ad.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("listing inet tables: %w", err)
	}
	return out, nil
}

// listSets lists the names of the sets of an inet table.
func (c *conn) listSets(table string) ([]string, error) {
	filter, err := mnl.MarshalAttributes([]mnl.Attribute{{Type: unix.NFTA_SET_TABLE, Data: append([]byte(table), 0)}})
	if err != nil {
		return nil, err
	}
	var out []string
	err = c.dump(unix.NFT_MSG_GETSET, unix.NFPROTO_INET, filter, func(_ uint8, attrs []byte) error {
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		var name, tbl string
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_SET_NAME:
				name = ad.String()
			case unix.NFTA_SET_TABLE:
				tbl = ad.String()
			}
		}
		if tbl == table {
			out = append(out, name)
		}
		return ad.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("listing sets of %s: %w", table, err)
	}
	return out, nil
}

// dumpRules calls fn for every rule of the inet family (one dump; the
// library dumps one chain per request).
func (c *conn) dumpRules(fn func(attrs []byte) error) error {
	err := c.dump(unix.NFT_MSG_GETRULE, unix.NFPROTO_INET, nil, func(_ uint8, attrs []byte) error { return fn(attrs) })
	if err != nil {
		return fmt.Errorf("dumping inet rules: %w", err)
	}
	return nil
}
