package nftables

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	nft "github.com/google/nftables"
	mnl "github.com/mdlayher/netlink"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// libraryMessages returns what google/nftables sends for the same objects:
// each message's type and payload (nfgenmsg and attributes), captured
// through the library's dial hook.
func libraryMessages(t *testing.T, build func(c *nft.Conn)) []string {
	t.Helper()
	var got []string
	c, err := nft.New(nft.WithTestDial(func(req []mnl.Message) ([]mnl.Message, error) {
		var acks []mnl.Message
		for _, m := range req {
			if m.Header.Type != mnl.HeaderType(0x10) && m.Header.Type != mnl.HeaderType(0x11) { // batch begin, end
				got = append(got, fmt.Sprintf("%#x %x", uint16(m.Header.Type), m.Data))
			}
			acks = append(acks, mnl.Message{Header: mnl.Header{Type: mnl.Error, Sequence: m.Header.Sequence}, Data: make([]byte, 4)})
		}
		return acks, nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	build(c)
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	return got
}

// ourMessages splits a transaction into the same form.
func ourMessages(t *testing.T, tx *tx) []string {
	t.Helper()
	if tx.err != nil {
		t.Fatal(tx.err)
	}
	var out []string
	for b := tx.b; len(b) > 0; {
		l := int(binary.NativeEndian.Uint32(b))
		typ := binary.NativeEndian.Uint16(b[4:])
		if typ != 0x10 && typ != 0x11 {
			out = append(out, fmt.Sprintf("%#x %x", typ, b[16:l]))
		}
		b = b[(l+3)&^3:]
	}
	return out
}

// TestEncodingMatchesLibrary: every message the transport encodes carries
// the same bytes google/nftables sends for the same table, set, chain and
// rule (headers aside: we ask fewer acks and no echo), so the transport
// changes how the rules travel, never what they are.
func TestEncodingMatchesLibrary(t *testing.T) {
	n := rules.Node{IPv6: true, RerouteInterfaces: []string{"tap0"}}
	sets := []RuleSet{BuildPodRules(n, rules.PodOptions{DNSCapture: true}), BuildHostRules(n, 1000)}
	tx := (&conn{}).begin()
	want := libraryMessages(t, func(c *nft.Conn) {
		for _, rs := range sets {
			for _, tb := range rs.Tables {
				table := c.AddTable(&nft.Table{Name: tb.Name, Family: inet})
				tx.addTable(tb.Name)
				for i, s := range tb.Sets {
					set := &nft.Set{Table: table, Name: s.Name, KeyType: nft.TypeIPAddr, Comment: probeSetComment, ID: uint32(i + 1)}
					if s.V6 {
						set.KeyType = nft.TypeIP6Addr
					}
					if err := c.AddSet(set, nil); err != nil {
						t.Fatal(err)
					}
					tx.addSet(tb.Name, s, uint32(i+1))
				}
				chains := map[string]*nft.Chain{}
				for _, ch := range tb.Chains {
					nc := &nft.Chain{Name: ch.Name, Table: table}
					if ch.base() {
						prio := nft.ChainPriority(ch.Priority)
						policy := nft.ChainPolicyAccept
						nc.Type, nc.Hooknum, nc.Priority, nc.Policy = ch.Type, ch.Hook, &prio, &policy
					}
					chains[ch.Name] = c.AddChain(nc)
					tx.addChain(tb.Name, ch)
				}
				for _, r := range tb.Rules {
					c.AddRule(&nft.Rule{Table: table, Chain: chains[r.Chain], Exprs: r.exprs()})
					tx.addRule(tb.Name, r)
				}
				for _, ch := range tb.Chains {
					c.FlushChain(chains[ch.Name])
					tx.flushChain(tb.Name, ch.Name)
					c.DelChain(chains[ch.Name])
					tx.delChain(tb.Name, ch.Name)
				}
				c.DelTable(table)
				tx.delTable(tb.Name)
			}
		}
	})
	got := ourMessages(t, tx)
	if len(got) != len(want) {
		t.Fatalf("%d messages, the library sends %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("message %d (%s) differs from the library's:\n got %s\nwant %s", i, tx.what[i], got[i], want[i])
		}
	}
	if !strings.Contains(strings.Join(tx.what, "\n"), "add rule istio-ambient-nat istio-output: ") {
		t.Errorf("messages not described: %q", tx.what)
	}
}
