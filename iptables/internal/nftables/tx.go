package nftables

import (
	"encoding/binary"
	"errors"
	"fmt"

	nft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

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

// addRule appends the rule to its chain, after its anonymous sets.
func (t *tx) addRule(table string, r Rule) {
	for _, a := range r.anon {
		t.addAnonSet(table, a)
	}
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

// anonSetName is how a transaction names a new anonymous set; the kernel
// numbers it.
const anonSetName = "__set%d"

// addAnonSet adds an anonymous constant set with its elements, as nft does
// for `{ 53, 15008 }` in a rule; a.id names it for the rule's lookup.
func (t *tx) addAnonSet(table string, a anonSet) {
	t.add(unix.NFT_MSG_NEWSET, unix.NLM_F_CREATE, "add anonymous set of "+table, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_SET_TABLE, table)
		ae.String(unix.NFTA_SET_NAME, anonSetName)
		ae.Uint32(unix.NFTA_SET_FLAGS, unix.NFT_SET_ANONYMOUS|unix.NFT_SET_CONSTANT)
		ae.Uint32(unix.NFTA_SET_KEY_TYPE, a.keyed.magic)
		ae.Uint32(unix.NFTA_SET_KEY_LEN, a.keyed.len)
		ae.Uint32(unix.NFTA_SET_ID, a.id)
		ae.Nested(unix.NFTA_SET_DESC, func(d *mnl.AttributeEncoder) error {
			d.Uint32(unix.NFTA_SET_DESC_SIZE, uint32(len(a.elems)))
			return nil
		})
		// Key byte order: big endian (nft's own, for every constant set).
		ae.Bytes(unix.NFTA_SET_USERDATA, userdata.AppendUint32(nil, userdata.NFTNL_UDATA_SET_KEYBYTEORDER, 2))
	})
	t.add(unix.NFT_MSG_NEWSETELEM, unix.NLM_F_CREATE, "add anonymous set elements of "+table, func(ae *mnl.AttributeEncoder) {
		ae.String(unix.NFTA_SET_ELEM_LIST_TABLE, table)
		ae.String(unix.NFTA_SET_ELEM_LIST_SET, anonSetName)
		ae.Uint32(unix.NFTA_SET_ELEM_LIST_SET_ID, a.id)
		ae.Nested(unix.NFTA_SET_ELEM_LIST_ELEMENTS, func(list *mnl.AttributeEncoder) error {
			for _, e := range a.elems {
				list.Nested(unix.NFTA_LIST_ELEM, func(el *mnl.AttributeEncoder) error {
					el.Nested(unix.NFTA_SET_ELEM_KEY, func(k *mnl.AttributeEncoder) error {
						k.Bytes(unix.NFTA_DATA_VALUE, e)
						return nil
					})
					return nil
				})
			}
			return nil
		})
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
