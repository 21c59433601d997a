package xtables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	goipt "github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Config is what the iptables-restore backend needs of the node's settings.
type Config struct {
	rules.Node
	// LockWait is how long iptables-restore waits for the xtables lock
	// (legacy mode). Default 10s.
	LockWait time.Duration
	// Timeout bounds every iptables process. Default 30s.
	Timeout time.Duration
	// Spawned, when set, counts the processes started, so tests can hold
	// each operation to its process budget.
	Spawned *atomic.Int64
}

func (c Config) withDefaults() Config {
	if c.LockWait == 0 {
		c.LockWait = 10 * time.Second
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.Spawned == nil {
		c.Spawned = new(atomic.Int64)
	}
	return c
}

// Backend is the iptables-restore backend of one variant (legacy or nft):
// one restore batch per family per operation, read back with one save. Its
// host methods handle the host rules only; the probe ipsets they match are
// package ipset's.
type Backend struct {
	cfg     Config
	log     *slog.Logger
	mode    rules.Mode
	tools   map[rules.Family]Tools
	spawned *atomic.Int64
}

// New resolves the variant's programs. primary: every family the node
// programs must have its tools (their version is logged), and with IPv6 off
// the IPv6 tools are resolved too when present, only so DeletePod can remove
// IPv6 rules someone else put into a dual-stack pod. Otherwise (another
// backend, only cleaned up) whatever families have tools; none is an error.
func New(cfg Config, log *slog.Logger, variant rules.Mode, primary bool) (*Backend, error) {
	cfg = cfg.withDefaults()
	b := &Backend{cfg: cfg, log: log, mode: variant, tools: map[rules.Family]Tools{}, spawned: cfg.Spawned}
	if !primary {
		for _, f := range []rules.Family{rules.IPv4, rules.IPv6} {
			if t, err := LookTools(f, variant); err == nil {
				b.tools[f] = t
			}
		}
		if len(b.tools) == 0 {
			return nil, fmt.Errorf("no %s iptables tools", variant)
		}
		return b, nil
	}
	for _, f := range b.Families() {
		t, err := LookTools(f, variant)
		if err != nil {
			return nil, err
		}
		b.tools[f] = t
	}
	for _, f := range b.Families() {
		// go-iptables reads the version and confirms the variant.
		cmd := strings.TrimSuffix(b.tools[f].Restore, "-restore")
		ipt, err := goipt.New(goipt.IPFamily(protoOf(f)), goipt.Path(cmd))
		if err != nil {
			return nil, fmt.Errorf("%s (%s): %w", f, variant, err)
		}
		v1, v2, v3 := ipt.GetIptablesVersion()
		log.Info("iptables backend", "family", f.String(), "mode", string(variant), "version", fmt.Sprintf("%d.%d.%d", v1, v2, v3))
	}
	if !cfg.IPv6 {
		// Not for programming: only so DeletePod can remove IPv6 rules
		// that someone else (Istio's agent, or ambientd run with --ipv6)
		// put into a dual-stack pod. Best effort: absent tools, no cleanup.
		if t, err := LookTools(rules.IPv6, variant); err == nil {
			b.tools[rules.IPv6] = t
		}
	}
	return b, nil
}

func protoOf(f rules.Family) goipt.Protocol {
	if f == rules.IPv6 {
		return goipt.ProtocolIPv6
	}
	return goipt.ProtocolIPv4
}

// Mode is the variant: legacy or nft.
func (b *Backend) Mode() rules.Mode { return b.mode }

// Families returns the address families the node programs.
func (b *Backend) Families() []rules.Family { return b.cfg.Families() }

// converge runs one optimistic batch per family (all families at once); for
// the families where it fails as a whole, it reads the state (one save) and
// runs the batch fix renders from it, unless that is empty.
func (b *Backend) converge(ctx context.Context, what string, fams []rules.Family, first func(rules.Family) string, fix func(rules.Family, saveState) string) error {
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = b.restoreProc(f, first(f))
	}
	_, errs := b.runAll(ctx, procs)
	var failed []rules.Family
	firstErr := map[rules.Family]error{}
	for i, f := range fams {
		if errs[i] != nil {
			failed = append(failed, f)
			firstErr[f] = errs[i]
		}
	}
	if len(failed) == 0 {
		return nil
	}
	states, err := b.saveAll(ctx, failed)
	if err != nil {
		return fmt.Errorf("%s: batch failed (%v), then reading the state failed: %w", what, errors.Join(errs...), err)
	}
	procs, fams = procs[:0], fams[:0:0]
	for _, f := range failed {
		b.log.Debug("iptables batch fell back to state-based repair", "op", what, "family", f.String(), "first_error", firstErr[f])
		if batch := fix(f, states[f]); batch != "" {
			procs = append(procs, b.restoreProc(f, batch))
			fams = append(fams, f)
		}
	}
	_, errs = b.runAll(ctx, procs)
	for i, err := range errs {
		if err != nil {
			return fmt.Errorf("%s %s: %w", what, fams[i], err)
		}
	}
	return nil
}

// apply installs rs in the current namespace. The common case, a namespace
// without our chains, costs one restore per family. Otherwise the state is
// read (one save) and, only if it differs, repaired (one restore).
func (b *Backend) apply(ctx context.Context, rs RuleSet) error {
	return b.converge(ctx, "apply", rs.Families(), rs.RenderApply, rs.renderRepair)
}

// remove deletes rs's chains and jumps from the current namespace: one
// restore per family when all are present, else one save plus, if anything
// of ours is left, one restore.
func (b *Backend) remove(ctx context.Context, rs RuleSet) error {
	return b.converge(ctx, "delete", rs.Families(), rs.RenderDelete,
		func(_ rules.Family, st saveState) string { return rs.renderDeleteFrom(st) })
}

// verify reads the state (one save per family) and diffs it against rs.
func (b *Backend) verify(ctx context.Context, rs RuleSet) (rules.Drift, error) {
	states, err := b.saveAll(ctx, rs.Families())
	if err != nil {
		return rules.Drift{}, err
	}
	var d rules.Drift
	for _, f := range rs.Families() {
		d.Add(rs.diff(f, states[f]))
	}
	return d, nil
}

// --- pod ----------------------------------------------------------------

// ApplyPod installs the pod's rules (see apply).
func (b *Backend) ApplyPod(ctx context.Context, opts rules.PodOptions, _ rules.View) error {
	return b.apply(ctx, BuildPodRules(b.cfg.Node, opts))
}

// VerifyPod reports how the pod's rules differ from opts' (one save per
// family).
func (b *Backend) VerifyPod(ctx context.Context, opts rules.PodOptions, _ rules.View) (rules.Drift, error) {
	return b.verify(ctx, BuildPodRules(b.cfg.Node, opts))
}

// DeletePod removes our chains and the jumps into them (see remove).
func (b *Backend) DeletePod(ctx context.Context, _ rules.View) error {
	return errors.Join(b.remove(ctx, BuildPodRules(b.cfg.Node, rules.PodOptions{})), b.removeForeignV6(ctx))
}

// removeForeignV6 removes our IPv6 chains from a dual-stack pod when IPv6 is
// off: they can only have been put there by someone else (Istio's agent, whose
// pods we adopt, or ambientd run with --ipv6), and left in place they would
// keep sending the pod's IPv6 connections to a ztunnel that no longer serves
// it. IPv4-only pods (no global IPv6 address) cost nothing: no process runs.
func (b *Backend) removeForeignV6(ctx context.Context) error {
	if _, ok := b.tools[rules.IPv6]; b.cfg.IPv6 || !ok {
		return nil
	}
	has, err := hasGlobalIPv6()
	if err != nil || !has {
		return err
	}
	n := b.cfg.Node
	n.IPv6 = true
	rs := BuildPodRules(n, rules.PodOptions{})
	return b.converge(ctx, "delete", []rules.Family{rules.IPv6}, rs.RenderDelete,
		func(_ rules.Family, st saveState) string { return rs.renderDeleteFrom(st) })
}

// hasGlobalIPv6 reports whether the current network namespace has an IPv6
// address that is neither loopback nor link-local (a dual-stack pod).
func hasGlobalIPv6() (bool, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return false, fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	addrs, err := h.AddrList(nil, netlink.FAMILY_V6)
	if err != nil {
		return false, fmt.Errorf("listing IPv6 addresses: %w", err)
	}
	for _, a := range addrs {
		if ip := a.IP; ip != nil && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
			return true, nil
		}
	}
	return false, nil
}

// HoldsPod reports whether our in-pod chains exist in this variant.
func (b *Backend) HoldsPod(ctx context.Context, v rules.View) (bool, error) {
	return b.holds(ctx, v, ChainPrerouting, ChainOutput)
}

// holds reports whether any of chains exists in this variant's tables of
// the families we have tools for. iptables-nft is read from v, the
// operation's read of the nftables chains (no process); legacy only runs a
// save when the kernel lists legacy tables in this namespace at all
// (someone used iptables-legacy here).
func (b *Backend) holds(ctx context.Context, v rules.View, chains ...string) (bool, error) {
	var fams []rules.Family
	for f := range b.tools {
		fams = append(fams, f)
	}
	if b.mode == rules.ModeNFT {
		if v == nil {
			return false, errors.New("iptables-nft chains unreadable: the namespace's nftables chains could not be listed")
		}
		for _, f := range fams {
			if v.HasChain(nfproto(f), chains...) {
				return true, nil
			}
		}
		return false, nil
	}
	var used []rules.Family
	for _, f := range fams {
		ok, err := LegacyTablesUsed(f)
		if err != nil {
			return false, err
		}
		if ok {
			used = append(used, f)
		}
	}
	if len(used) == 0 {
		return false, nil
	}
	states, err := b.saveAll(ctx, used)
	if err != nil {
		return false, err
	}
	for _, st := range states {
		for _, ts := range st {
			for _, c := range chains {
				if ts.chains[c] {
					return true, nil
				}
			}
		}
	}
	return false, nil
}

// nfproto is the nftables family iptables-nft keeps f's tables in.
func nfproto(f rules.Family) uint8 {
	if f == rules.IPv6 {
		return unix.NFPROTO_IPV6
	}
	return unix.NFPROTO_IPV4
}

// LegacyTablesUsed reports whether the kernel has any legacy iptables table
// of f in the calling thread's namespace (thread-self: the thread may be
// inside a pod's namespace while the process is not). It is what
// `iptables-legacy-save` (no -t) lists, and it creates nothing.
func LegacyTablesUsed(f rules.Family) (bool, error) {
	name := "/proc/thread-self/net/ip_tables_names"
	if f == rules.IPv6 {
		name = "/proc/thread-self/net/ip6_tables_names"
	}
	b, err := os.ReadFile(name)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil // module not loaded: no legacy tables anywhere
	}
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", name, err)
	}
	return strings.TrimSpace(string(b)) != "", nil
}

// EnsureLegacyTable makes the kernel instantiate the legacy table of family
// f in the calling thread's namespace (an empty one if it had none): one
// `iptables-legacy-restore --noflush` of just "*table / COMMIT". Nothing in
// it changes when the table exists. Only for the legacy variant.
func (b *Backend) EnsureLegacyTable(ctx context.Context, f rules.Family, table string) error {
	if b.mode != rules.ModeLegacy {
		return fmt.Errorf("ensure table %s: %s is not the legacy variant", table, b.mode)
	}
	if _, ok := b.tools[f]; !ok {
		return fmt.Errorf("ensure table %s: no %s tools of the legacy variant", table, f)
	}
	_, errs := b.runAll(ctx, []proc{b.restoreProc(f, "*"+table+"\nCOMMIT\n")})
	if errs[0] != nil {
		return fmt.Errorf("ensure legacy %s table %s: %w", f, table, errs[0])
	}
	return nil
}
