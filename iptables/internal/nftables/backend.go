package nftables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Config is what the nftables backend needs of the node's settings.
type Config struct {
	rules.Node
	// KubeletUID is the uid whose sockets get probe SNAT (Istio's nft host
	// rule matches the kubelet's uid). Nil: found by scanning HostProc for
	// kubelet, kubelite or k3s (primary backend only), else 0.
	KubeletUID *uint32
	// HostProc is the node's /proc, for the kubelet scan.
	HostProc string
}

// Backend programs Istio's native-nftables layout over netlink (see
// netlink.go; github.com/google/nftables for the expressions and the
// probe-set elements): no process is spawned. Apply and delete are
// one netlink transaction each, which the kernel commits atomically (a
// failed transaction leaves the rules as they were); verify is one read of
// our tables compared expression by expression.
type Backend struct {
	cfg        Config
	log        *slog.Logger
	kubeletUID uint32
	cache      *cache
	sidecar    *sidecarCache
	// closing counts sockets being released in the background (see
	// conn.close).
	closing *sync.WaitGroup
}

// cache keeps what verification would otherwise recompute for every pod:
// the wanted rule sets with their keys (per pod options) and the key of each
// rule encoding read back from the kernel (bounded), so a steady-state
// verify only walks the dump.
type cache struct {
	mu   sync.Mutex
	sets map[rules.PodOptions]RuleSet
	host *RuleSet
	raw  map[string]string
}

const maxRawKeys = 4096

func (c *cache) rawKey(raw string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k, ok := c.raw[raw]
	return k, ok
}

func (c *cache) putRaw(raw, key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.raw) < maxRawKeys {
		c.raw[raw] = key
	}
}

// prepare fills every rule's key and its encoding for the kernel.
func prepare(rs RuleSet) (RuleSet, error) {
	for ti := range rs.Tables {
		for ri := range rs.Tables[ti].Rules {
			r := &rs.Tables[ti].Rules[ri]
			k, err := r.keyOf()
			if err != nil {
				return rs, err
			}
			if r.enc, err = encodeExprs(r.exprs()); err != nil {
				return rs, err
			}
			r.key = k
		}
	}
	return rs, nil
}

func (b *Backend) podRules(opts rules.PodOptions) (RuleSet, error) {
	b.cache.mu.Lock()
	rs, ok := b.cache.sets[opts]
	b.cache.mu.Unlock()
	if ok {
		return rs, nil
	}
	rs, err := prepare(BuildPodRules(b.cfg.Node, opts))
	if err != nil {
		return rs, err
	}
	b.cache.mu.Lock()
	b.cache.sets[opts] = rs
	b.cache.mu.Unlock()
	return rs, nil
}

// New checks that nf_tables answers in the current namespace and, for the
// primary backend, resolves the kubelet uid for the host rule (logged with
// the choice). bg counts the sockets released in the background.
func New(ctx context.Context, cfg Config, log *slog.Logger, bg *sync.WaitGroup, primary bool) (*Backend, error) {
	b := &Backend{cfg: cfg, log: log, closing: bg, cache: &cache{sets: map[rules.PodOptions]RuleSet{}, raw: map[string]string{}},
		sidecar: &sidecarCache{}}
	if _, err := b.holdsAny(); err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	switch {
	case cfg.KubeletUID != nil:
		b.kubeletUID = *cfg.KubeletUID
	case primary:
		uid, err := findKubeletUID(cfg.HostProc)
		if err != nil {
			log.Warn("kubelet process not found; nftables probe SNAT keyed on uid 0 (set the kubelet uid explicitly if it runs as another user)", "error", err)
		}
		b.kubeletUID = uid
	}
	if primary {
		log.Info("rule backend", "mode", string(rules.ModeNFTables), "kubelet_uid", b.kubeletUID)
	}
	return b, ctx.Err()
}

// Mode is nftables.
func (b *Backend) Mode() rules.Mode { return rules.ModeNFTables }

// open returns the operation's socket: the view's when there is one
// (released with the view), else a new one in the calling thread's
// namespace, released by done.
func (b *Backend) open(v *View) (c *conn, done func(), err error) {
	if v != nil {
		return v.c, func() {}, nil
	}
	if c, err = dial(b.closing); err != nil {
		return nil, nil, err
	}
	return c, c.close, nil
}

// background runs fn (a socket release) in a goroutine counted by wg.
func background(wg *sync.WaitGroup, fn func() error) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = fn()
	}()
}

// view returns v when it is a View this package read, else nil.
func view(v rules.View) *View {
	nv, _ := v.(*View)
	return nv
}

// holdsAny reports whether an inet table among names exists.
func (b *Backend) holdsAny(names ...string) (bool, error) {
	c, done, err := b.open(nil)
	if err != nil {
		return false, err
	}
	defer done()
	tables, err := c.listTables()
	return slices.ContainsFunc(tables, func(t string) bool { return slices.Contains(names, t) }), err
}

// --- pod ----------------------------------------------------------------

// ApplyPod makes the pod's tables exactly opts' in one transaction, or
// writes nothing when they already are (see converge).
func (b *Backend) ApplyPod(ctx context.Context, opts rules.PodOptions, v rules.View) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	rs, err := b.podRules(opts)
	if err != nil {
		return err
	}
	nv := view(v)
	c, done, err := b.open(nv)
	if err != nil {
		return err
	}
	defer done()
	_, err = b.converge(c, nv, rs)
	return err
}

// VerifyPod reports how the pod's tables differ from opts': with the
// operation's view, one rule dump on its socket.
func (b *Backend) VerifyPod(ctx context.Context, opts rules.PodOptions, v rules.View) (rules.Drift, error) {
	rs, err := b.podRules(opts)
	if err != nil {
		return rules.Drift{}, err
	}
	if nv := view(v); nv != nil {
		// Everything needed is in the view and one rule dump on its
		// socket.
		if err := ctx.Err(); err != nil {
			return rules.Drift{}, err
		}
		st, err := readNFT(nv.c, nv, rs.TableNames(), false, b.cache)
		if err != nil {
			return rules.Drift{}, err
		}
		return rs.diff(st)
	}
	return b.verify(ctx, rs)
}

func (b *Backend) verify(ctx context.Context, rs RuleSet) (rules.Drift, error) {
	var d rules.Drift
	if err := ctx.Err(); err != nil {
		return d, err
	}
	c, done, err := b.open(nil)
	if err != nil {
		return d, err
	}
	defer done()
	st, err := readNFT(c, nil, rs.TableNames(), rs.hasSets(), b.cache)
	if err != nil {
		return d, err
	}
	return rs.diff(st)
}

// DeletePod deletes those of our tables that exist, in one transaction.
func (b *Backend) DeletePod(ctx context.Context, v rules.View) error {
	return b.deleteTables(ctx, v, PodTables())
}

// HoldsPod reports whether any of our pod tables exists.
func (b *Backend) HoldsPod(_ context.Context, v rules.View) (bool, error) {
	return b.holdsTables(v, PodTables())
}

// deleteTables deletes those of names (inet tables) that exist in the
// namespace v reads, in one transaction; none there: no transaction.
func (b *Backend) deleteTables(ctx context.Context, v rules.View, names []string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	nv := view(v)
	if nv != nil && len(nv.tables(names)) == 0 {
		return nil
	}
	c, done, err := b.open(nv)
	if err != nil {
		return err
	}
	defer done()
	return b.remove(c, nv, names)
}

// holdsTables reports whether any of names (inet tables) exists, from v
// when the caller read the namespace already.
func (b *Backend) holdsTables(v rules.View, names []string) (bool, error) {
	if nv := view(v); nv != nil {
		return nv.has(unix.NFPROTO_INET, names, nil), nil
	}
	return b.holdsAny(names...)
}

// --- host ---------------------------------------------------------------

func (b *Backend) hostRules() RuleSet {
	b.cache.mu.Lock()
	defer b.cache.mu.Unlock()
	if b.cache.host == nil {
		rs, err := prepare(BuildHostRules(b.cfg.Node, b.kubeletUID))
		if err != nil {
			return BuildHostRules(b.cfg.Node, b.kubeletUID) // keys computed on use
		}
		b.cache.host = &rs
	}
	return *b.cache.host
}

// EnsureHost makes the node's nat table (probe sets and SNAT chain) exactly
// ours; existing sets keep their elements.
func (b *Backend) EnsureHost(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c, done, err := b.open(nil)
	if err != nil {
		return err
	}
	defer done()
	if _, err := b.converge(c, nil, b.hostRules()); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	return nil
}

// VerifyHost reports how the node's nat table differs.
func (b *Backend) VerifyHost(ctx context.Context) (rules.Drift, error) {
	return b.verify(ctx, b.hostRules())
}

// DeleteHost deletes the node's nat table, sets and all.
func (b *Backend) DeleteHost(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c, done, err := b.open(nil)
	if err != nil {
		return err
	}
	defer done()
	return b.remove(c, nil, []string{TableNat})
}

// HoldsHost reports whether the node's nat table of ours exists.
func (b *Backend) HoldsHost(context.Context, rules.View) (bool, error) {
	return b.holdsAny(TableNat)
}

// Dump returns what `nft list ruleset` prints (the nft program must exist).
// It changes nothing.
func (b *Backend) Dump(ctx context.Context) (string, error) {
	nftProg, err := exec.LookPath("nft")
	if err != nil {
		return "", fmt.Errorf("listing %s rules needs the nft program: %w", rules.ModeNFTables, err)
	}
	out, err := exec.CommandContext(ctx, nftProg, "list", "ruleset").CombinedOutput()
	if err != nil {
		return "", errors.Join(fmt.Errorf("nft list ruleset: %w", err), errors.New(strings.TrimSpace(string(out))))
	}
	return "# nft list ruleset\n" + string(out), nil
}
