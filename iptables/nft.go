package iptables

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// nftBackend programs Istio's native-nftables layout over netlink
// (github.com/google/nftables): no process is spawned. Apply and delete are
// one netlink transaction each, which the kernel commits atomically (a
// failed transaction leaves the rules as they were); verify is one read of
// our tables compared expression by expression.
type nftBackend struct {
	cfg        Config
	log        *slog.Logger
	kubeletUID uint32
	cache      *nftCache
	// closing counts sockets being released in the background (see with).
	closing *sync.WaitGroup
}

// nftCache keeps what verification would otherwise recompute for every pod:
// the wanted rule sets with their keys (per pod options) and the key of each
// rule encoding read back from the kernel (bounded), so a steady-state
// verify only walks the dump.
type nftCache struct {
	mu   sync.Mutex
	sets map[PodOptions]NFTRuleSet
	host *NFTRuleSet
	raw  map[string]string
}

const maxRawKeys = 4096

func (c *nftCache) rawKey(raw string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k, ok := c.raw[raw]
	return k, ok
}

func (c *nftCache) putRaw(raw, key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.raw) < maxRawKeys {
		c.raw[raw] = key
	}
}

// withKeys fills every rule's key.
func withKeys(rs NFTRuleSet) (NFTRuleSet, error) {
	for ti := range rs.Tables {
		for ri := range rs.Tables[ti].Rules {
			r := &rs.Tables[ti].Rules[ri]
			k, err := exprKey(r.exprs())
			if err != nil {
				return rs, err
			}
			r.key = k
		}
	}
	return rs, nil
}

func (n *nftBackend) podRules(opts PodOptions) (NFTRuleSet, error) {
	n.cache.mu.Lock()
	rs, ok := n.cache.sets[opts]
	n.cache.mu.Unlock()
	if ok {
		return rs, nil
	}
	rs, err := withKeys(BuildPodRulesNFT(n.cfg, opts))
	if err != nil {
		return rs, err
	}
	n.cache.mu.Lock()
	n.cache.sets[opts] = rs
	n.cache.mu.Unlock()
	return rs, nil
}

const inet = nftables.TableFamilyINet

// newNFTables checks that nf_tables answers in the current namespace and,
// for the primary backend, resolves the kubelet uid for the host rule.
func newNFTables(ctx context.Context, cfg Config, log *slog.Logger, bg *sync.WaitGroup, primary bool) (*nftBackend, error) {
	n := &nftBackend{cfg: cfg, log: log, closing: bg, cache: &nftCache{sets: map[PodOptions]NFTRuleSet{}, raw: map[string]string{}}}
	err := n.with(func(c *nftables.Conn) error {
		_, err := c.ListTablesOfFamily(inet)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	switch {
	case cfg.KubeletUID != nil:
		n.kubeletUID = *cfg.KubeletUID
	case primary:
		uid, err := findKubeletUID(cfg.HostProc)
		if err != nil {
			log.Warn("kubelet process not found; nftables probe SNAT keyed on uid 0 (set the kubelet uid explicitly if it runs as another user)", "err", err)
		}
		n.kubeletUID = uid
	}
	return n, ctx.Err()
}

func (n *nftBackend) name() Mode { return ModeNFTables }

// with opens one netlink socket in the calling thread's namespace for the
// whole operation and releases it in the background: the kernel makes the
// release of any nftables socket wait while objects deleted by a committed
// transaction (ours or another pod's) await destruction after an RCU grace
// period — several ms on the pod's critical path for nothing, since the
// transaction is already committed. Bounded: a release returns after the
// grace period.
func (n *nftBackend) with(fn func(c *nftables.Conn) error) error {
	c, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer background(n.closing, c.CloseLasting)
	return fn(c)
}

// background runs fn (a socket release) in a goroutine counted by wg.
func background(wg *sync.WaitGroup, fn func() error) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = fn()
	}()
}

// --- reading ------------------------------------------------------------

type nftTableState struct {
	table  *nftables.Table
	chains []*nftables.Chain
	rules  map[string][]ruleRead // chain -> rules in order
	sets   []string
}

// ruleRead is a rule as read back: its handle and its expressions' key.
type ruleRead struct {
	handle uint64
	key    string
}

// readNFT reads the given tables of ours that exist (that have a chain):
// chains, rules and (withSets) set names. The chains come from v when given
// (one dump of every family shared by the operation), else from one dump on
// c; when any table is ours, one dump reads every rule of the family.
func readNFT(c *nftables.Conn, v *nsView, names []string, withSets bool, cache *nftCache, bg *sync.WaitGroup) (map[string]*nftTableState, error) {
	var chains []*nftables.Chain
	if v != nil {
		chains = v.chains
	} else {
		var err error
		if chains, err = c.ListChainsOfTableFamily(inet); err != nil {
			return nil, fmt.Errorf("listing inet chains: %w", err)
		}
	}
	st := map[string]*nftTableState{}
	for _, ch := range chains {
		if ch.Table.Family != inet || !slices.Contains(names, ch.Table.Name) {
			continue
		}
		ts := st[ch.Table.Name]
		if ts == nil {
			ts = &nftTableState{table: ch.Table, rules: map[string][]ruleRead{}}
			st[ch.Table.Name] = ts
		}
		ts.chains = append(ts.chains, ch)
	}
	if len(st) == 0 {
		return st, nil
	}
	if err := dumpRules(st, cache, bg); err != nil {
		return nil, err
	}
	if !withSets {
		return st, nil
	}
	for name, ts := range st {
		sets, err := c.GetSets(ts.table)
		if err != nil {
			return nil, fmt.Errorf("listing sets of %s: %w", name, err)
		}
		for _, s := range sets {
			ts.sets = append(ts.sets, s.Name)
		}
	}
	return st, nil
}

// nsView is one read of every nftables chain of the calling thread's
// namespace, all families: the backends of one pod operation share it
// (ours in inet, iptables-nft's in ip/ip6) instead of each dumping chains on
// a socket of its own.
type nsView struct {
	chains []*nftables.Chain
}

// readView takes the view: one socket, one dump.
func readView(bg *sync.WaitGroup) (*nsView, error) {
	c, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	defer background(bg, c.CloseLasting)
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyUnspecified)
	if err != nil {
		return nil, fmt.Errorf("listing nftables chains: %w", err)
	}
	return &nsView{chains: chains}, nil
}

// has reports whether a chain exists in a table of one of fams, whose table
// is one of tables (any table when nil) and whose name is one of names (any
// chain when nil).
func (v *nsView) has(fams []nftables.TableFamily, tables, names []string) bool {
	return slices.ContainsFunc(v.chains, func(ch *nftables.Chain) bool {
		return slices.Contains(fams, ch.Table.Family) &&
			(tables == nil || slices.Contains(tables, ch.Table.Name)) &&
			(names == nil || slices.Contains(names, ch.Name))
	})
}

// tables returns the inet tables among names that have a chain in v.
func (v *nsView) tables(names []string) []*nftables.Table {
	var out []*nftables.Table
	for _, ch := range v.chains {
		if ch.Table.Family == inet && slices.Contains(names, ch.Table.Name) &&
			!slices.ContainsFunc(out, func(t *nftables.Table) bool { return t.Name == ch.Table.Name }) {
			out = append(out, ch.Table)
		}
	}
	return out
}

// dumpRules reads every rule of the inet family with one netlink dump (the
// library dumps one chain per request) and files those of st's tables.
func dumpRules(st map[string]*nftTableState, cache *nftCache, bg *sync.WaitGroup) error {
	conn, err := mnl.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer background(bg, conn.Close)
	msgs, err := conn.Execute(mnl.Message{
		Header: mnl.Header{Type: mnl.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETRULE), Flags: mnl.Request | mnl.Dump},
		Data:   []byte{unix.NFPROTO_INET, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return fmt.Errorf("dumping inet rules: %w", err)
	}
	for _, msg := range msgs {
		if len(msg.Data) < 4 {
			continue
		}
		table, chain, r, err := parseRule(msg.Data[4:], cache)
		if err != nil {
			return fmt.Errorf("parsing a rule of %s %s: %w", table, chain, err)
		}
		if ts := st[table]; ts != nil {
			ts.rules[chain] = append(ts.rules[chain], r)
		}
	}
	return nil
}

// parseRule decodes one NFT_MSG_NEWRULE message. Expressions are decoded
// with the library's types and re-encoded for the key, so a rule compares
// equal to the one we would send; an expression of a kind we never use is
// kept as its raw bytes (it can only match nothing of ours). The key of an
// encoding seen before comes from the cache.
func parseRule(b []byte, cache *nftCache) (table, chain string, r ruleRead, err error) {
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
	if k, ok := cache.rawKey(raw.String()); ok {
		r.key = k
		return table, chain, r, nil
	}
	var exprs []expr.Any
	var opaque bytes.Buffer
	for _, el := range elems {
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
	key, err := exprKey(exprs)
	if err != nil {
		return table, chain, r, err
	}
	r.key = key + opaque.String()
	cache.putRaw(raw.String(), r.key)
	return table, chain, r, nil
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
func exprKey(exprs []expr.Any) (string, error) {
	var b bytes.Buffer
	for _, e := range exprs {
		switch v := e.(type) {
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

func sameBase(have *nftables.Chain, want NFTChain) bool {
	if !want.base() {
		return have.Hooknum == nil
	}
	return have.Hooknum != nil && *have.Hooknum == *want.Hook && have.Type == want.Type &&
		have.Priority != nil && int32(*have.Priority) == want.Priority
}

// diff compares the wanted set with what was read: tables, sets (by name),
// chains (with their hooks), and each chain's rules in order.
func (rs NFTRuleSet) diff(st map[string]*nftTableState) (Drift, error) {
	var d Drift
	for _, t := range rs.Tables {
		prefix := "nft inet " + t.Name
		ts := st[t.Name]
		if ts == nil {
			d.Missing = append(d.Missing, "nft add table inet "+t.Name)
			ts = &nftTableState{rules: map[string][]ruleRead{}}
		}
		for _, s := range t.Sets {
			if !slices.Contains(ts.sets, s.Name) {
				d.Missing = append(d.Missing, prefix+": set "+s.Name)
			}
		}
		have := map[string]*nftables.Chain{}
		for _, ch := range ts.chains {
			have[ch.Name] = ch
			if !slices.ContainsFunc(t.Chains, func(c NFTChain) bool { return c.Name == ch.Name }) {
				d.Unexpected = append(d.Unexpected, prefix+": chain "+ch.Name)
			}
		}
		for _, c := range t.Chains {
			hc := have[c.Name]
			switch {
			case hc == nil:
				d.Missing = append(d.Missing, prefix+": chain "+c.Name)
			case !sameBase(hc, c):
				d.Unexpected = append(d.Unexpected, prefix+": chain "+c.Name+" has another type, hook or priority")
			}
			var want, got []string
			text := map[string]string{}
			for _, r := range t.Rules {
				if r.Chain != c.Name {
					continue
				}
				k := r.key
				if k == "" {
					var err error
					if k, err = exprKey(r.exprs()); err != nil {
						return d, err
					}
				}
				want = append(want, k)
				text[k] = r.Text()
			}
			handles := map[string][]uint64{}
			for _, r := range ts.rules[c.Name] {
				got = append(got, r.key)
				handles[r.key] = append(handles[r.key], r.handle)
			}
			m, u := multisetDiff(want, got)
			for _, k := range m {
				d.Missing = append(d.Missing, prefix+" "+c.Name+": "+text[k])
			}
			for _, k := range u {
				line := fmt.Sprintf("%s %s: rule handle %d", prefix, c.Name, handles[k][0])
				if t, ok := text[k]; ok {
					line += " (duplicate) " + t
				}
				handles[k] = handles[k][1:]
				d.Unexpected = append(d.Unexpected, line)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(want, got) {
				d.Unexpected = append(d.Unexpected, prefix+" "+c.Name+": rules out of order")
			}
		}
	}
	return d, nil
}

// --- writing ------------------------------------------------------------

// converge makes the tables of rs exactly rs in one transaction, unless they
// already are (then nothing is written). Existing tables of ours are kept
// with their sets (and set elements); their chains are flushed and deleted
// and ours recreated, all inside the one atomic commit, so packets see the
// old rules or the new ones, never none.
func (n *nftBackend) converge(c *nftables.Conn, v *nsView, rs NFTRuleSet) (bool, error) {
	st, err := readNFT(c, v, rs.TableNames(), rs.hasSets(), n.cache, n.closing)
	if err != nil {
		return false, err
	}
	if len(st) > 0 {
		d, err := rs.diff(st)
		if err != nil || d.Empty() {
			return false, err
		}
	}
	for _, t := range rs.Tables {
		table := c.AddTable(&nftables.Table{Name: t.Name, Family: inet})
		ts := st[t.Name]
		if ts != nil {
			for _, ch := range ts.chains {
				c.FlushChain(ch)
			}
			for _, ch := range ts.chains {
				c.DelChain(ch)
			}
		}
		for _, s := range t.Sets {
			if ts != nil && slices.Contains(ts.sets, s.Name) {
				continue
			}
			set := probeNFTSet(table, s.V6)
			if err := c.AddSet(set, nil); err != nil {
				return false, fmt.Errorf("set %s: %w", s.Name, err)
			}
		}
		chains := map[string]*nftables.Chain{}
		for _, ch := range t.Chains {
			nc := &nftables.Chain{Name: ch.Name, Table: table}
			if ch.base() {
				prio := nftables.ChainPriority(ch.Priority)
				policy := nftables.ChainPolicyAccept
				nc.Type, nc.Hooknum, nc.Priority, nc.Policy = ch.Type, ch.Hook, &prio, &policy
			}
			chains[ch.Name] = c.AddChain(nc)
		}
		for _, r := range t.Rules {
			c.AddRule(&nftables.Rule{Table: table, Chain: chains[r.Chain], Exprs: r.exprs()})
		}
	}
	if err := c.Flush(); err != nil {
		return false, fmt.Errorf("nftables transaction: %w", err)
	}
	return true, nil
}

func probeNFTSet(table *nftables.Table, v6 bool) *nftables.Set {
	s := &nftables.Set{Table: table, Name: ProbeSetV4, KeyType: nftables.TypeIPAddr, Comment: probeSetComment}
	if v6 {
		s.Name, s.KeyType = ProbeSetV6, nftables.TypeIP6Addr
	}
	return s
}

// remove deletes the named tables that exist (as listed on c, or seen in
// v), in one transaction.
func (n *nftBackend) remove(c *nftables.Conn, v *nsView, names []string) error {
	var tables []*nftables.Table
	if v != nil {
		tables = v.tables(names)
	} else {
		all, err := c.ListTablesOfFamily(inet)
		if err != nil {
			return fmt.Errorf("listing inet tables: %w", err)
		}
		for _, t := range all {
			if slices.Contains(names, t.Name) {
				tables = append(tables, t)
			}
		}
	}
	if len(tables) == 0 {
		return nil
	}
	for _, t := range tables {
		c.DelTable(t)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables transaction: %w", err)
	}
	return nil
}

func (n *nftBackend) holdsAny(names ...string) (bool, error) {
	var held bool
	err := n.with(func(c *nftables.Conn) error {
		tables, err := c.ListTablesOfFamily(inet)
		for _, t := range tables {
			held = held || slices.Contains(names, t.Name)
		}
		return err
	})
	return held, err
}

var podNFTTables = []string{NFTTableNat, NFTTableMangle, NFTTableRaw}

func (n *nftBackend) applyPod(ctx context.Context, opts PodOptions, v *nsView) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	rs, err := n.podRules(opts)
	if err != nil {
		return err
	}
	return n.with(func(c *nftables.Conn) error {
		_, err := n.converge(c, v, rs)
		return err
	})
}

func (n *nftBackend) verifyPod(ctx context.Context, opts PodOptions, v *nsView) (Drift, error) {
	rs, err := n.podRules(opts)
	if err != nil {
		return Drift{}, err
	}
	if v != nil {
		// Everything needed is in the view and one rule dump: no socket
		// of the library's is opened.
		if err := ctx.Err(); err != nil {
			return Drift{}, err
		}
		st, err := readNFT(nil, v, rs.TableNames(), false, n.cache, n.closing)
		if err != nil {
			return Drift{}, err
		}
		return rs.diff(st)
	}
	return n.verify(ctx, rs)
}

func (n *nftBackend) verify(ctx context.Context, rs NFTRuleSet) (Drift, error) {
	var d Drift
	if err := ctx.Err(); err != nil {
		return d, err
	}
	err := n.with(func(c *nftables.Conn) error {
		st, err := readNFT(c, nil, rs.TableNames(), rs.hasSets(), n.cache, n.closing)
		if err != nil {
			return err
		}
		d, err = rs.diff(st)
		return err
	})
	return d, err
}

func (n *nftBackend) deletePod(ctx context.Context, v *nsView) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if v != nil && len(v.tables(podNFTTables)) == 0 {
		return nil // nothing of ours: no socket, no transaction
	}
	return n.with(func(c *nftables.Conn) error { return n.remove(c, v, podNFTTables) })
}

func (n *nftBackend) holdsPod(_ context.Context, v *nsView) (bool, error) {
	if v != nil {
		return v.has([]nftables.TableFamily{inet}, podNFTTables, nil), nil
	}
	return n.holdsAny(podNFTTables...)
}

// --- host ---------------------------------------------------------------

func (n *nftBackend) hostRules() NFTRuleSet {
	n.cache.mu.Lock()
	defer n.cache.mu.Unlock()
	if n.cache.host == nil {
		rs, err := withKeys(BuildHostRulesNFT(n.cfg, n.kubeletUID))
		if err != nil {
			return BuildHostRulesNFT(n.cfg, n.kubeletUID) // keys computed on use
		}
		n.cache.host = &rs
	}
	return *n.cache.host
}

func (n *nftBackend) ensureHost(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return n.with(func(c *nftables.Conn) error {
		if _, err := n.converge(c, nil, n.hostRules()); err != nil {
			return fmt.Errorf("host probe rules: %w", err)
		}
		return nil
	})
}

func (n *nftBackend) verifyHost(ctx context.Context) (Drift, error) {
	return n.verify(ctx, n.hostRules())
}

func (n *nftBackend) deleteHost(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return n.with(func(c *nftables.Conn) error { return n.remove(c, nil, []string{NFTTableNat}) })
}

func (n *nftBackend) holdsHost(context.Context) (bool, error) { return n.holdsAny(NFTTableNat) }

// nftStore is the probe sets as nftables sets in the node's nat table
// (element comment = pod uid).
type nftStore struct {
	c     *nftables.Conn
	table *nftables.Table
}

func (n *nftBackend) probes() (probeStore, func(), error) {
	c, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	// Released in the background (see with).
	return nftStore{c: c, table: &nftables.Table{Name: NFTTableNat, Family: inet}}, func() { background(n.closing, c.CloseLasting) }, nil
}

func (s nftStore) set(f Family) *nftables.Set { return probeNFTSet(s.table, f == IPv6) }

func noSet(err error) error {
	if errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("%w: %w", errNoSet, err)
	}
	return err
}

func (s nftStore) list(f Family) (map[netip.Addr]string, error) {
	set, err := s.c.GetSetByName(s.table, f.probeSet())
	if err != nil {
		return nil, fmt.Errorf("listing nft set %s: %w", f.probeSet(), noSet(err))
	}
	elems, err := s.c.GetSetElements(set)
	if err != nil {
		return nil, fmt.Errorf("listing nft set %s: %w", f.probeSet(), noSet(err))
	}
	out := make(map[netip.Addr]string, len(elems))
	for _, e := range elems {
		if a, ok := netip.AddrFromSlice(e.Key); ok {
			out[a.Unmap()] = e.Comment
		}
	}
	return out, nil
}

// add puts the element in; relabelling is a delete and an add in the same
// transaction (an add of an existing element keeps its old comment).
func (s nftStore) add(f Family, ip netip.Addr, uid string, relabel bool) error {
	set := s.set(f)
	if relabel {
		if err := s.c.SetDeleteElements(set, []nftables.SetElement{{Key: ip.AsSlice()}}); err != nil {
			return err
		}
	}
	if err := s.c.SetAddElements(set, []nftables.SetElement{{Key: ip.AsSlice(), Comment: uid}}); err != nil {
		return err
	}
	if err := s.c.Flush(); err != nil {
		return fmt.Errorf("adding %s (pod %s) to nft set %s: %w", ip, uid, f.probeSet(), noSet(err))
	}
	return nil
}

func (s nftStore) del(f Family, ip netip.Addr) error {
	if err := s.c.SetDeleteElements(s.set(f), []nftables.SetElement{{Key: ip.AsSlice()}}); err != nil {
		return err
	}
	if err := s.c.Flush(); err != nil {
		return fmt.Errorf("removing %s from nft set %s: %w", ip, f.probeSet(), noSet(err))
	}
	return nil
}

// --- environment --------------------------------------------------------

// nftablesSupported checks, with one transaction that creates and deletes a
// scratch table (the commit nets out to nothing), that the kernel accepts
// what our rules need: inet nat chains, redirect, conntrack mark and zone,
// a set lookup and SNAT.
func nftablesSupported() error {
	c, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer c.CloseLasting()
	t := c.AddTable(&nftables.Table{Name: "ambientd-probe-" + strconv.Itoa(os.Getpid()), Family: inet})
	set := probeNFTSet(t, false)
	if err := c.AddSet(set, nil); err != nil {
		return err
	}
	prio := nftables.ChainPriority(nftPrioritySrcNAT)
	post := c.AddChain(&nftables.Chain{Name: "post", Table: t, Type: nftables.ChainTypeNAT, Hooknum: nftables.ChainHookPostrouting, Priority: &prio})
	out := c.AddChain(&nftables.Chain{Name: "out", Table: t, Type: nftables.ChainTypeNAT, Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityNATDest})
	for _, r := range []struct {
		chain *nftables.Chain
		stmts []nftStmt
	}{
		{out, []nftStmt{port("tcp", "dport", true, 1), mark(true, ProxyMark), counter(), redirect(OutboundPort)}},
		{out, []nftStmt{ctmark(ConnMark), restoreMark()}},
		{out, []nftStmt{setConnmark(), ctZone(1)}},
		{post, []nftStmt{skuid(0), inSet(IPv4, ProbeSetV4), snatTo(ProbeSNATv4)}},
	} {
		c.AddRule(&nftables.Rule{Table: t, Chain: r.chain, Exprs: NFTRule{stmts: r.stmts}.exprs()})
	}
	c.DelTable(t)
	return c.Flush()
}

// findKubeletUID returns the uid of the kubelet-hosting process (kubelet,
// MicroK8s' kubelite, k3s) found in procDir, as Istio keys its nft probe
// SNAT; 0 when none is found.
func findKubeletUID(procDir string) (uint32, error) {
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", procDir, err)
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		dir := filepath.Join(procDir, e.Name())
		comm, err := os.ReadFile(filepath.Join(dir, "comm"))
		if err != nil {
			continue
		}
		switch strings.TrimSpace(string(comm)) {
		case "kubelet", "kubelite":
			cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
			if err != nil || !strings.Contains(strings.ToLower(string(cmdline)), "kubelet") {
				continue
			}
		case "k3s":
		default:
			continue
		}
		status, err := os.ReadFile(filepath.Join(dir, "status"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(status), "\n") {
			if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
				if f := strings.Fields(rest); len(f) > 0 {
					if uid, err := strconv.ParseUint(f[0], 10, 32); err == nil {
						return uint32(uid), nil
					}
				}
			}
		}
	}
	return 0, fmt.Errorf("no kubelet process in %s", procDir)
}

// iptablesNFTChains reports whether iptables-nft holds any of chains in its
// ip/ip6 tables of the current namespace, read over netlink (one dump of
// every family's chains, no process).
func iptablesNFTChains(bg *sync.WaitGroup, fams []Family, chains ...string) (bool, error) {
	c, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return false, fmt.Errorf("netlink: %w", err)
	}
	defer background(bg, c.CloseLasting)
	list, err := c.ListChainsOfTableFamily(nftables.TableFamilyUnspecified)
	if err != nil {
		return false, fmt.Errorf("listing chains: %w", err)
	}
	var nf []nftables.TableFamily
	for _, f := range fams {
		nf = append(nf, nftFamily(f))
	}
	return (&nsView{chains: list}).has(nf, nil, chains), nil
}

// nftFamily is the nftables family iptables-nft keeps f's tables in.
func nftFamily(f Family) nftables.TableFamily {
	if f == IPv6 {
		return nftables.TableFamilyIPv6
	}
	return nftables.TableFamilyIPv4
}
