package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	goipt "github.com/coreos/go-iptables/iptables"
)

// Mode selects the iptables variant.
type Mode string

const (
	// ModeAuto follows whichever variant already holds rules on the node,
	// else nft.
	ModeAuto   Mode = "auto"
	ModeLegacy Mode = "legacy"
	ModeNFT    Mode = "nft"
)

// ParseMode accepts "", "auto", "legacy" and "nft".
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeAuto:
		return ModeAuto, nil
	case ModeLegacy, ModeNFT:
		return Mode(s), nil
	}
	return "", fmt.Errorf("iptables mode %q: want auto, legacy or nft", s)
}

// Config is the node-wide rule configuration.
type Config struct {
	// IPv6 adds ip6tables rules (and the IPv6 policy route and probe set).
	IPv6 bool
	// DNSCapture is the default for pods without the dns-capture annotation.
	DNSCapture bool
	// RerouteInterfaces are virtual interfaces (e.g. a VM's tap) whose TCP
	// entering the pod is sent to ztunnel's outbound port.
	RerouteInterfaces []string
	// Mode is auto (default), legacy or nft.
	Mode Mode
	// LockWait is how long iptables-restore waits for the xtables lock
	// (legacy mode). Default 10s.
	LockWait time.Duration
	// Timeout bounds every iptables process. Default 30s.
	Timeout time.Duration
}

// Validate checks the config, naming what is wrong.
func (c Config) Validate() error {
	if _, err := ParseMode(string(c.Mode)); err != nil {
		return err
	}
	for _, i := range c.RerouteInterfaces {
		if i == "" || len(i) > 15 || strings.ContainsAny(i, " \t\n/!\"'") || i == "." || i == ".." {
			return fmt.Errorf("reroute interface %q is not a valid interface name", i)
		}
	}
	if c.LockWait < 0 || c.Timeout < 0 {
		return errors.New("iptables lock wait and timeout must not be negative")
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Mode == "" {
		c.Mode = ModeAuto
	}
	if c.LockWait == 0 {
		c.LockWait = 10 * time.Second
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	return c
}

// tools are the resolved save/restore programs of one family.
type tools struct {
	save, restore string
}

// Manager applies, verifies and deletes rule sets with the variant chosen
// once at construction. It holds no per-pod state and is safe for
// concurrent use.
type Manager struct {
	cfg   Config
	log   *slog.Logger
	mode  Mode
	tools map[Family]tools
	// spawned counts iptables processes started, so tests can hold the
	// process budget of each operation.
	spawned atomic.Int64
	// probeMu serializes the probe-set operations, which list then change.
	probeMu sync.Mutex
}

// NewManager validates the config, resolves the iptables variant once (an
// explicit mode wins; else the variant that already holds rules in the
// current namespace, i.e. the node's; else nft) and checks its programs.
func NewManager(ctx context.Context, cfg Config, log *slog.Logger) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg = cfg.withDefaults()
	m := &Manager{cfg: cfg, log: log, mode: cfg.Mode, tools: map[Family]tools{}}
	if m.mode == ModeAuto {
		mode, err := m.detect(ctx)
		if err != nil {
			return nil, err
		}
		m.mode = mode
	}
	for _, f := range m.families() {
		t, err := lookTools(f, m.mode)
		if err != nil {
			return nil, err
		}
		m.tools[f] = t
		// go-iptables reads the version and confirms the variant.
		cmd := strings.TrimSuffix(t.restore, "-restore")
		ipt, err := goipt.New(goipt.IPFamily(protoOf(f)), goipt.Path(cmd))
		if err != nil {
			return nil, fmt.Errorf("%s (%s): %w", f, m.mode, err)
		}
		v1, v2, v3 := ipt.GetIptablesVersion()
		log.Info("iptables backend", "family", f.String(), "mode", string(m.mode), "version", fmt.Sprintf("%d.%d.%d", v1, v2, v3))
	}
	if !cfg.IPv6 {
		// Not for programming: only so DeletePod can remove IPv6 rules
		// that someone else (Istio's agent, or ambientd run with --ipv6)
		// put into a dual-stack pod. Best effort: absent tools, no cleanup.
		if t, err := lookTools(IPv6, m.mode); err == nil {
			m.tools[IPv6] = t
		}
	}
	return m, nil
}

func protoOf(f Family) goipt.Protocol {
	if f == IPv6 {
		return goipt.ProtocolIPv6
	}
	return goipt.ProtocolIPv4
}

// Mode returns the resolved variant (legacy or nft).
func (m *Manager) Mode() Mode { return m.mode }

// Config returns the manager's config with defaults filled in.
func (m *Manager) Config() Config { return m.cfg }

func (m *Manager) families() []Family {
	if m.cfg.IPv6 {
		return []Family{IPv4, IPv6}
	}
	return []Family{IPv4}
}

func lookTools(f Family, mode Mode) (tools, error) {
	base := "iptables"
	if f == IPv6 {
		base = "ip6tables"
	}
	var t tools
	var err error
	if t.save, err = lookPath(fmt.Sprintf("%s-%s-save", base, mode)); err != nil {
		return t, err
	}
	if t.restore, err = lookPath(fmt.Sprintf("%s-%s-restore", base, mode)); err != nil {
		return t, err
	}
	return t, nil
}

func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		if p, err := exec.LookPath(dir + "/" + name); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH, /usr/sbin or /sbin", name)
}

// detect counts the rules each variant holds in the current namespace and
// picks the one with more, nft on a tie (as the Kubernetes iptables-wrapper
// does), so the agent joins whatever kubelet and kube-proxy already use.
func (m *Manager) detect(ctx context.Context) (Mode, error) {
	count := map[Mode]int{}
	for _, mode := range []Mode{ModeLegacy, ModeNFT} {
		for _, f := range m.families() {
			t, err := lookTools(f, mode)
			if err != nil {
				m.log.Debug("iptables variant unavailable", "mode", string(mode), "err", err)
				continue
			}
			out, err := m.run(ctx, t.save, nil)
			if err != nil {
				m.log.Debug("iptables variant unreadable", "mode", string(mode), "err", err)
				continue
			}
			count[mode] += strings.Count(out, "\n-A ")
		}
	}
	mode := ModeNFT
	if count[ModeLegacy] > count[ModeNFT] {
		mode = ModeLegacy
	}
	m.log.Info("iptables mode detected", "mode", string(mode), "legacy_rules", count[ModeLegacy], "nft_rules", count[ModeNFT])
	return mode, nil
}

// proc is one iptables-save or iptables-restore invocation.
type proc struct {
	path  string
	stdin []byte
	args  []string
}

func (m *Manager) restoreProc(f Family, batch string) proc {
	return proc{path: m.tools[f].restore, stdin: []byte(batch),
		args: []string{"--noflush", "--wait=" + strconv.Itoa(max(1, int((m.cfg.LockWait+time.Second-1)/time.Second)))}}
}

func (m *Manager) saveProc(f Family) proc { return proc{path: m.tools[f].save} }

// run runs one program; see runAll.
func (m *Manager) run(ctx context.Context, path string, stdin []byte, args ...string) (string, error) {
	outs, errs := m.runAll(ctx, []proc{{path: path, stdin: stdin, args: args}})
	return outs[0], errs[0]
}

// runAll starts every process from the calling goroutine, so on a thread
// locked into a namespace each child inherits that namespace, lets them run
// side by side (IPv4 and IPv6 at once) and waits for all. Bounded by ctx and
// cfg.Timeout.
func (m *Manager) runAll(ctx context.Context, procs []proc) ([]string, []error) {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	outs := make([]string, len(procs))
	errs := make([]error, len(procs))
	cmds := make([]*exec.Cmd, len(procs))
	stdouts := make([]bytes.Buffer, len(procs))
	stderrs := make([]bytes.Buffer, len(procs))
	for i, p := range procs {
		cmd := exec.CommandContext(ctx, p.path, p.args...)
		cmd.Stdout, cmd.Stderr = &stdouts[i], &stderrs[i]
		if p.stdin != nil {
			cmd.Stdin = bytes.NewReader(p.stdin)
		}
		cmd.WaitDelay = time.Second
		m.spawned.Add(1)
		if err := cmd.Start(); err != nil {
			errs[i] = fmt.Errorf("starting %s: %w", p.path, err)
			continue
		}
		cmds[i] = cmd
	}
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		if err := cmd.Wait(); err != nil {
			errs[i] = fmt.Errorf("%s %s: %w: %s", procs[i].path, strings.Join(procs[i].args, " "), err, strings.TrimSpace(stderrs[i].String()))
		}
		outs[i] = stdouts[i].String()
	}
	return outs, errs
}

// saveAll reads the state of the given families, one save each, concurrently.
func (m *Manager) saveAll(ctx context.Context, fams []Family) (map[Family]saveState, error) {
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = m.saveProc(f)
	}
	outs, errs := m.runAll(ctx, procs)
	states := map[Family]saveState{}
	for i, f := range fams {
		if errs[i] != nil {
			return nil, errs[i]
		}
		st, err := parseSave(outs[i])
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.tools[f].save, err)
		}
		states[f] = st
	}
	return states, nil
}

// converge runs one optimistic batch per family (all families at once); for
// the families where it fails as a whole, it reads the state (one save) and
// runs the batch fix renders from it, unless that is empty.
func (m *Manager) converge(ctx context.Context, what string, fams []Family, first func(Family) string, fix func(Family, saveState) string) error {
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = m.restoreProc(f, first(f))
	}
	_, errs := m.runAll(ctx, procs)
	var failed []Family
	firstErr := map[Family]error{}
	for i, f := range fams {
		if errs[i] != nil {
			failed = append(failed, f)
			firstErr[f] = errs[i]
		}
	}
	if len(failed) == 0 {
		return nil
	}
	states, err := m.saveAll(ctx, failed)
	if err != nil {
		return fmt.Errorf("%s: batch failed (%v), then reading the state failed: %w", what, errors.Join(errs...), err)
	}
	procs, fams = procs[:0], fams[:0:0]
	for _, f := range failed {
		m.log.Debug("iptables batch fell back to state-based repair", "op", what, "family", f.String(), "first_error", firstErr[f])
		if batch := fix(f, states[f]); batch != "" {
			procs = append(procs, m.restoreProc(f, batch))
			fams = append(fams, f)
		}
	}
	_, errs = m.runAll(ctx, procs)
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
func (m *Manager) apply(ctx context.Context, rs RuleSet) error {
	return m.converge(ctx, "apply", rs.Families(), rs.RenderApply, rs.renderRepair)
}

// remove deletes rs's chains and jumps from the current namespace: one
// restore per family when all are present, else one save plus, if anything
// of ours is left, one restore.
func (m *Manager) remove(ctx context.Context, rs RuleSet) error {
	return m.converge(ctx, "delete", rs.Families(), rs.RenderDelete,
		func(_ Family, st saveState) string { return rs.renderDeleteFrom(st) })
}

// verify reads the state (one save per family) and diffs it against rs.
func (m *Manager) verify(ctx context.Context, rs RuleSet) (Drift, error) {
	states, err := m.saveAll(ctx, rs.Families())
	if err != nil {
		return Drift{}, err
	}
	var d Drift
	for _, f := range rs.Families() {
		d.add(rs.diff(f, states[f]))
	}
	return d, nil
}

// inNS runs fn on a locked OS thread inside netns. ns.Do restores the thread
// afterwards and, if it cannot, leaves it locked so the runtime discards it
// instead of reusing a thread stuck in the pod's namespace.
func inNS(netns ns.NetNS, what string, fn func() error) error {
	err := netns.Do(func(ns.NetNS) error { return fn() })
	if err != nil {
		return fmt.Errorf("%s in netns %s: %w", what, netns.Path(), err)
	}
	return nil
}

// ApplyPod installs the pod's rules and policy route inside podNS. It is
// idempotent: on a pod that already has exactly these rules it changes
// nothing; on one with different or partial rules of ours it converges.
func (m *Manager) ApplyPod(ctx context.Context, podNS ns.NetNS, opts PodOptions) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	rs := BuildPodRules(m.cfg, opts)
	return inNS(podNS, "apply pod rules", func() error {
		if err := ensurePolicyRoute(m.cfg.IPv6); err != nil {
			return err
		}
		return m.apply(ctx, rs)
	})
}

// VerifyPod reports how the pod's rules and policy route differ from what
// ApplyPod would install (one save per family, no change).
func (m *Manager) VerifyPod(ctx context.Context, podNS ns.NetNS, opts PodOptions) (Drift, error) {
	if err := ctx.Err(); err != nil {
		return Drift{}, err
	}
	rs := BuildPodRules(m.cfg, opts)
	var d Drift
	err := inNS(podNS, "verify pod rules", func() error {
		rd, err := verifyPolicyRoute(m.cfg.IPv6)
		if err != nil {
			return err
		}
		d.add(rd)
		fd, err := m.verify(ctx, rs)
		d.add(fd)
		return err
	})
	return d, err
}

// DeletePod removes exactly our chains, jumps and policy route from podNS,
// leaving built-in chains and anyone else's rules alone. Nothing of ours
// left is success.
func (m *Manager) DeletePod(ctx context.Context, podNS ns.NetNS) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	rs := BuildPodRules(m.cfg, PodOptions{})
	return inNS(podNS, "delete pod rules", func() error {
		return errors.Join(m.remove(ctx, rs), m.removeForeignV6(ctx), deletePolicyRoute())
	})
}

// removeForeignV6 removes our IPv6 chains from a dual-stack pod when IPv6 is
// off: they can only have been put there by someone else (Istio's agent, whose
// pods we adopt, or ambientd run with --ipv6), and left in place they would
// keep sending the pod's IPv6 connections to a ztunnel that no longer serves
// it. IPv4-only pods (no global IPv6 address) cost nothing: no process runs.
func (m *Manager) removeForeignV6(ctx context.Context) error {
	if _, ok := m.tools[IPv6]; m.cfg.IPv6 || !ok {
		return nil
	}
	has, err := hasGlobalIPv6()
	if err != nil || !has {
		return err
	}
	cfg := m.cfg
	cfg.IPv6 = true
	rs := BuildPodRules(cfg, PodOptions{})
	return m.converge(ctx, "delete", []Family{IPv6}, rs.RenderDelete,
		func(_ Family, st saveState) string { return rs.renderDeleteFrom(st) })
}
