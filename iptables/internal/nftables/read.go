package nftables

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"sync"

	nft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

const inet = nft.TableFamilyINet

type tableState struct {
	chains []chainInfo
	rules  map[string][]ruleRead // chain -> rules in order
	sets   []string
}

// ruleRead is a rule as read back: its handle and its expressions' key.
type ruleRead struct {
	handle uint64
	key    string
	// anon holds the expressions of a rule whose lookups name anonymous
	// sets: its key is made once their elements are read.
	anon []expr.Any
}

// View is one read of every nftables chain of a namespace, all families:
// the backends of one operation share it (ours in inet, iptables-nft's in
// ip/ip6) instead of each dumping chains on a socket of its own, and the
// nftables backend goes on using its socket for the rest of the operation.
// It implements rules.View. Close releases the socket.
type View struct {
	c      *conn
	chains []chainInfo
}

// ReadView opens a socket in the calling thread's namespace and reads the
// chains: one dump. closing counts the socket's release in the background
// (see conn.close).
func ReadView(closing *sync.WaitGroup) (*View, error) {
	c, err := dial(closing)
	if err != nil {
		return nil, err
	}
	chains, err := c.listChains(unix.NFPROTO_UNSPEC)
	if err != nil {
		c.close()
		return nil, err
	}
	return &View{c: c, chains: chains}, nil
}

// Close releases the view's socket; nil-safe.
func (v *View) Close() {
	if v != nil {
		v.c.close()
	}
}

// HasChain reports whether a chain named one of names exists in a table of
// family nfproto.
func (v *View) HasChain(nfproto uint8, names ...string) bool {
	return v.has(nfproto, nil, names)
}

// has reports whether a chain exists in a table of family fam, whose table
// is one of tables (any table when nil) and whose name is one of names (any
// chain when nil).
func (v *View) has(fam uint8, tables, names []string) bool {
	return slices.ContainsFunc(v.chains, func(ch chainInfo) bool {
		return ch.family == fam &&
			(tables == nil || slices.Contains(tables, ch.table)) &&
			(names == nil || slices.Contains(names, ch.name))
	})
}

// tables returns those of the inet tables names that have a chain in v.
func (v *View) tables(names []string) []string {
	var out []string
	for _, ch := range v.chains {
		if ch.family == unix.NFPROTO_INET && slices.Contains(names, ch.table) && !slices.Contains(out, ch.table) {
			out = append(out, ch.table)
		}
	}
	return out
}

// readNFT reads the given tables of ours that exist (that have a chain):
// chains, rules and (withSets) set names, on c. The chains come from v when
// given (the operation's dump of every family), else from a dump of the
// inet family; when any table is ours, one dump reads every rule of the
// family.
func readNFT(c *conn, v *View, names []string, withSets bool, cache *cache) (map[string]*tableState, error) {
	var chains []chainInfo
	if v != nil {
		chains = v.chains
	} else {
		var err error
		if chains, err = c.listChains(unix.NFPROTO_INET); err != nil {
			return nil, err
		}
	}
	st := map[string]*tableState{}
	for _, ch := range chains {
		if ch.family != unix.NFPROTO_INET || !slices.Contains(names, ch.table) {
			continue
		}
		ts := st[ch.table]
		if ts == nil {
			ts = &tableState{rules: map[string][]ruleRead{}}
			st[ch.table] = ts
		}
		ts.chains = append(ts.chains, ch)
	}
	if len(st) == 0 {
		return st, nil
	}
	err := c.dumpRules(func(attrs []byte) error {
		table, chain, r, err := parseRule(attrs, cache)
		if err != nil {
			return fmt.Errorf("parsing a rule of %s %s: %w", table, chain, err)
		}
		if ts := st[table]; ts != nil {
			ts.rules[chain] = append(ts.rules[chain], r)
		}
		return nil
	})
	if err != nil {
		return st, err
	}
	if err := keyAnonRules(c, st); err != nil {
		return st, err
	}
	if !withSets {
		return st, nil
	}
	for name, ts := range st {
		if ts.sets, err = c.listSets(name); err != nil {
			return nil, err
		}
	}
	return st, nil
}

// parseRule decodes one NFT_MSG_NEWRULE message. Expressions are decoded
// with the library's types and re-encoded for the key, so a rule compares
// equal to the one we would send; an expression of a kind we never use is
// kept as its raw bytes (it can only match nothing of ours). The key of an
// encoding seen before comes from the cache.
func parseRule(b []byte, cache *cache) (table, chain string, r ruleRead, err error) {
	ad, err := mnl.NewAttributeDecoder(b)
	if err != nil {
		return "", "", r, err
	}
	ad.ByteOrder = binary.BigEndian
	type elem struct {
		name string
		data []byte
	}
	var elems []elem
	var raw strings.Builder
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_RULE_TABLE:
			table = ad.String()
		case unix.NFTA_RULE_CHAIN:
			chain = ad.String()
		case unix.NFTA_RULE_HANDLE:
			r.handle = ad.Uint64()
		case unix.NFTA_RULE_EXPRESSIONS:
			ad.Nested(func(list *mnl.AttributeDecoder) error {
				for list.Next() {
					list.Nested(func(e *mnl.AttributeDecoder) error {
						var el elem
						for e.Next() {
							switch e.Type() {
							case unix.NFTA_EXPR_NAME:
								el.name = e.String()
							case unix.NFTA_EXPR_DATA:
								el.data = e.Bytes()
							}
						}
						elems = append(elems, el)
						raw.WriteString(el.name)
						if el.name != "counter" { // its values change
							raw.Write(el.data)
						}
						raw.WriteByte(0)
						return nil
					})
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return table, chain, r, err
	}
	anon := strings.Contains(raw.String(), "__set")
	if k, ok := cache.rawKey(raw.String()); ok && !anon {
		r.key = k
		return table, chain, r, nil
	}
	var exprs []expr.Any
	var opaque bytes.Buffer
	for _, el := range elems {
		if el.name == "tproxy" {
			// The library decodes its family attribute with the wrong
			// width; read it here (see tproxyKey).
			tp, err := decodeTProxy(el.data)
			if err != nil {
				return table, chain, r, fmt.Errorf("expression tproxy: %w", err)
			}
			exprs = append(exprs, tp)
			continue
		}
		x := newExpr(el.name)
		if x == nil {
			fmt.Fprintf(&opaque, "%s:%x;", el.name, el.data)
			continue
		}
		if err := expr.Unmarshal(byte(inet), el.data, x); err != nil {
			return table, chain, r, fmt.Errorf("expression %s: %w", el.name, err)
		}
		if imm, ok := x.(*expr.Immediate); ok && imm.Register == unix.NFT_REG_VERDICT && len(imm.Data) == 0 {
			x = &expr.Verdict{}
			if err := expr.Unmarshal(byte(inet), el.data, x); err != nil {
				return table, chain, r, fmt.Errorf("verdict: %w", err)
			}
		}
		exprs = append(exprs, x)
	}
	if anon && slices.ContainsFunc(exprs, isAnonLookup) {
		// Keyed once the sets' elements are read (keyAnonRules); the set
		// names differ between namespaces, so never cached.
		r.anon = exprs
		r.key = opaque.String()
		return table, chain, r, nil
	}
	key, err := exprKey(exprs)
	if err != nil {
		return table, chain, r, err
	}
	r.key = key + opaque.String()
	cache.putRaw(raw.String(), r.key)
	return table, chain, r, nil
}

func isAnonLookup(e expr.Any) bool {
	l, ok := e.(*expr.Lookup)
	return ok && strings.HasPrefix(l.SetName, "__set")
}

// keyAnonRules keys the rules whose lookups name anonymous sets, with the
// sets' elements (one dump per set).
func keyAnonRules(c *conn, st map[string]*tableState) error {
	for table, ts := range st {
		elems := map[string][][]byte{}
		for chain, rs := range ts.rules {
			for i, r := range rs {
				if r.anon == nil {
					continue
				}
				key, err := exprKeyAnon(r.anon, func(l *expr.Lookup) ([][]byte, bool) {
					if _, ok := elems[l.SetName]; !ok {
						e, err := c.setElems(table, l.SetName)
						if err != nil {
							return nil, false
						}
						elems[l.SetName] = e
					}
					return elems[l.SetName], true
				})
				if err != nil {
					return fmt.Errorf("rule of %s %s: %w", table, chain, err)
				}
				rs[i].key, rs[i].anon = key+r.key, nil
			}
		}
	}
	return nil
}

// newExpr returns an empty expression of the kinds our rules use.
func newExpr(name string) expr.Any {
	switch name {
	case "meta":
		return &expr.Meta{}
	case "cmp":
		return &expr.Cmp{}
	case "payload":
		return &expr.Payload{}
	case "bitwise":
		return &expr.Bitwise{}
	case "counter":
		return &expr.Counter{}
	case "immediate":
		return &expr.Immediate{}
	case "redir":
		return &expr.Redir{}
	case "nat":
		return &expr.NAT{}
	case "ct":
		return &expr.Ct{}
	case "lookup":
		return &expr.Lookup{}
	}
	return nil
}

// exprKey is a rule's expressions as the kernel encodes them (counter values
// zeroed), so a wanted rule and one read back compare byte for byte.
func exprKey(exprs []expr.Any) (string, error) { return exprKeyAnon(exprs, nil) }

// exprKeyAnon is exprKey where a lookup into an anonymous set is keyed by
// the set's elements (anon resolves them), not by its name: the kernel
// names the set (__set0, ...) and the name differs between namespaces.
func exprKeyAnon(exprs []expr.Any, anon func(*expr.Lookup) ([][]byte, bool)) (string, error) {
	var b bytes.Buffer
	for _, e := range exprs {
		switch v := e.(type) {
		case *expr.TProxy:
			fmt.Fprintf(&b, "tproxy{family=%d addr=%d port=%d}", v.Family, v.RegAddr, v.RegPort)
			continue
		case *expr.Lookup:
			if anon != nil && strings.HasPrefix(v.SetName, "__set") {
				if elems, ok := anon(v); ok {
					e = &expr.Lookup{SourceRegister: v.SourceRegister, DestRegister: v.DestRegister, IsDestRegSet: v.IsDestRegSet,
						Invert: v.Invert, SetName: elemsKey(elems)}
				}
			}
		case *expr.Counter:
			e = &expr.Counter{}
		case *expr.Ct:
			// The library reads a ct set back without its source
			// register; compare sets as (key, direction) only.
			if v.SourceRegister {
				e = &expr.Ct{Key: v.Key, Direction: v.Direction}
			}
		}
		data, err := expr.Marshal(byte(inet), e)
		if err != nil {
			return "", fmt.Errorf("encoding %T: %w", e, err)
		}
		b.Write(data)
	}
	return b.String(), nil
}

// elemsKey names a set by its elements, in a stable order.
func elemsKey(elems [][]byte) string {
	hexes := make([]string, len(elems))
	for i, e := range elems {
		hexes[i] = fmt.Sprintf("%x", e)
	}
	slices.Sort(hexes)
	return "{" + strings.Join(hexes, ",") + "}"
}

// decodeTProxy reads a tproxy expression's attributes (family, address and
// port registers, each a 32-bit big-endian number).
func decodeTProxy(data []byte) (*expr.TProxy, error) {
	ad, err := mnl.NewAttributeDecoder(data)
	if err != nil {
		return nil, err
	}
	ad.ByteOrder = binary.BigEndian
	tp := &expr.TProxy{TableFamily: byte(inet)}
	for ad.Next() {
		switch ad.Type() {
		case expr.NFTA_TPROXY_FAMILY:
			tp.Family = byte(ad.Uint32())
		case expr.NFTA_TPROXY_REG_ADDR:
			tp.RegAddr = ad.Uint32()
		case expr.NFTA_TPROXY_REG_PORT:
			tp.RegPort = ad.Uint32()
		}
	}
	return tp, ad.Err()
}
