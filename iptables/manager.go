package iptables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	goipt "github.com/coreos/go-iptables/iptables"
)

// Mode selects the rule backend.
type Mode string

const (
	// ModeAuto keeps the backend chosen before (persisted in StateDir),
	// else the one already holding our host rules, else nftables where the
	// kernel supports it, else the iptables variant holding more rules.
	ModeAuto Mode = "auto"
	// ModeLegacy and ModeNFT are iptables-restore batches of the legacy and
	// the nf_tables variant of the iptables tools.
	ModeLegacy Mode = "legacy"
	ModeNFT    Mode = "nft"
	// ModeNFTables is native nftables over netlink (Istio's nft layout), no
	// process spawned.
	ModeNFTables Mode = "nftables"
)

// ParseMode accepts "", "auto", "legacy", "nft" and "nftables".
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeAuto:
		return ModeAuto, nil
	case ModeLegacy, ModeNFT, ModeNFTables:
		return Mode(s), nil
	}
	return "", fmt.Errorf("iptables mode %q: want auto, legacy, nft or nftables", s)
}

// DefaultIPv6 is whether ambientd captures IPv6 unless told otherwise: on,
// as in Istio's chart (the rules are harmless in IPv4-only pods, and a
// dual-stack pod must never run with its IPv6 traffic uncaptured). The one
// default of `ambientd run`, `ambientd rules` and `ambientd uninstall`.
const DefaultIPv6 = true

// Config is the node-wide rule configuration.
type Config struct {
	// IPv6 adds ip6tables rules (and the IPv6 policy route and probe set).
	// The zero value is off; callers take DefaultIPv6.
	IPv6 bool
	// DNSCapture is the default for pods without the dns-capture annotation.
	DNSCapture bool
	// RerouteInterfaces are virtual interfaces (e.g. a VM's tap) whose TCP
	// entering the pod is sent to ztunnel's outbound port.
	RerouteInterfaces []string
	// Mode is auto (default), legacy, nft or nftables.
	Mode Mode
	// StateDir is where the chosen backend is persisted, so it survives
	// restarts (a tmpfs such as /var/run/ambientd: gone after a reboot, as
	// the rules are). Empty: nothing persisted.
	StateDir string
	// KubeletUID is the uid whose sockets get probe SNAT with the nftables
	// backend (Istio's nft host rule matches the kubelet's uid). Nil: found
	// by scanning HostProc for kubelet, kubelite or k3s, else 0.
	KubeletUID *uint32
	// HostProc is the node's /proc (default /proc), for the kubelet scan.
	HostProc string
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
		if err := ValidInterfaceName(i); err != nil {
			return err
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
	if c.HostProc == "" {
		c.HostProc = "/proc"
	}
	return c
}

// Manager applies, verifies and deletes rule sets with the backend chosen
// once at construction. It holds no per-pod state and is safe for
// concurrent use.
type Manager struct {
	cfg  Config
	log  *slog.Logger
	mode Mode
	be   backend
	// others are the other backends whose tools exist: a pod or node may
	// hold our rules there (the backend changed, or Istio's agent used
	// another one), so delete removes them, verify reports them and apply
	// moves the pod onto be.
	others []backend
	// spawned counts iptables processes started, so tests can hold the
	// process budget of each operation.
	spawned atomic.Int64
	// probeMu serializes the probe-set operations, which read then change,
	// and guards probeCache.
	probeMu    sync.Mutex
	probeCache *probeCache
	// bg counts netlink sockets being released in the background.
	bg sync.WaitGroup
}

// NewManager validates the config, resolves the backend once (see ModeAuto;
// an explicit mode wins) in the current namespace, i.e. the node's, persists
// the choice in StateDir and checks the backend's programs.
func NewManager(ctx context.Context, cfg Config, log *slog.Logger) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg = cfg.withDefaults()
	m := &Manager{cfg: cfg, log: log, mode: cfg.Mode}
	if m.mode == ModeAuto {
		mode, err := m.choose(ctx)
		if err != nil {
			return nil, err
		}
		m.mode = mode
	}
	be, err := m.newBackend(ctx, m.mode, true)
	if err != nil {
		return nil, err
	}
	m.be = be
	for _, other := range []Mode{ModeLegacy, ModeNFT, ModeNFTables} {
		if other == m.mode {
			continue
		}
		if o, err := m.newBackend(ctx, other, false); err == nil {
			m.others = append(m.others, o)
		} else {
			log.Debug("other rule backend unavailable", "backend", string(other), "err", err)
		}
	}
	if err := m.persist(); err != nil {
		return nil, err
	}
	return m, nil
}

// newBackend builds the backend of mode. primary: the families the config
// programs must all be available (and the version is logged); otherwise
// (another backend, only cleaned up) whatever families exist.
func (m *Manager) newBackend(ctx context.Context, mode Mode, primary bool) (backend, error) {
	if mode == ModeNFTables {
		n, err := newNFTables(ctx, m.cfg, m.log, &m.bg, primary)
		if err == nil && primary {
			m.log.Info("rule backend", "mode", string(mode), "kubelet_uid", n.kubeletUID)
		}
		return n, err
	}
	if !primary {
		var fams []Family
		for _, f := range []Family{IPv4, IPv6} {
			if _, err := lookTools(f, mode); err == nil {
				fams = append(fams, f)
			}
		}
		if len(fams) == 0 {
			return nil, fmt.Errorf("no %s iptables tools", mode)
		}
		return newXtables(m.cfg, m.log, mode, &m.spawned, &m.bg, fams)
	}
	x, err := newXtables(m.cfg, m.log, mode, &m.spawned, &m.bg, m.families())
	if err != nil {
		return nil, err
	}
	for _, f := range m.families() {
		// go-iptables reads the version and confirms the variant.
		cmd := strings.TrimSuffix(x.tools[f].restore, "-restore")
		ipt, err := goipt.New(goipt.IPFamily(protoOf(f)), goipt.Path(cmd))
		if err != nil {
			return nil, fmt.Errorf("%s (%s): %w", f, mode, err)
		}
		v1, v2, v3 := ipt.GetIptablesVersion()
		m.log.Info("iptables backend", "family", f.String(), "mode", string(mode), "version", fmt.Sprintf("%d.%d.%d", v1, v2, v3))
	}
	if !m.cfg.IPv6 {
		// Not for programming: only so DeletePod can remove IPv6 rules
		// that someone else (Istio's agent, or ambientd run with --ipv6)
		// put into a dual-stack pod. Best effort: absent tools, no cleanup.
		if t, err := lookTools(IPv6, mode); err == nil {
			x.tools[IPv6] = t
		}
	}
	return x, nil
}

func protoOf(f Family) goipt.Protocol {
	if f == IPv6 {
		return goipt.ProtocolIPv6
	}
	return goipt.ProtocolIPv4
}

// Mode returns the resolved backend (legacy, nft or nftables).
func (m *Manager) Mode() Mode { return m.mode }

// Config returns the manager's config with defaults filled in.
func (m *Manager) Config() Config { return m.cfg }

func (m *Manager) families() []Family {
	if m.cfg.IPv6 {
		return []Family{IPv4, IPv6}
	}
	return []Family{IPv4}
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
// nothing; on one with different or partial rules of ours it converges. Our
// rules found in another backend (the pod was enrolled by Istio's agent in
// another mode, or before the backend changed) are removed after ours are in
// place, so the pod is never uncaptured.
func (m *Manager) ApplyPod(ctx context.Context, podNS ns.NetNS, opts PodOptions) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := opts.Validate(); err != nil {
		return fmt.Errorf("apply pod rules: %w", err)
	}
	return inNS(podNS, "apply pod rules", func() error {
		if err := ensurePolicyRoute(m.cfg.IPv6); err != nil {
			return err
		}
		v := m.view()
		if err := m.be.applyPod(ctx, opts, v); err != nil {
			return err
		}
		holding, err := m.othersHolding(ctx, v)
		for _, o := range holding {
			m.log.Info("removing our rules of another backend from the pod", "backend", string(o.name()), "netns", podNS.Path())
			if err := o.deletePod(ctx, v); err != nil {
				return fmt.Errorf("removing %s rules: %w", o.name(), err)
			}
		}
		return err
	})
}

// view reads the namespace's nftables chains once for the operation; nil
// (each backend reads for itself) when that fails, e.g. on a kernel without
// nf_tables under the legacy backend.
func (m *Manager) view() *nsView {
	v, err := readView(&m.bg)
	if err != nil {
		m.log.Debug("nftables chains unreadable", "err", err)
		return nil
	}
	return v
}

// othersHolding returns the other backends that hold in-pod rules of ours in
// the current namespace.
func (m *Manager) othersHolding(ctx context.Context, v *nsView) ([]backend, error) {
	var out []backend
	for _, o := range m.others {
		held, err := o.holdsPod(ctx, v)
		if err != nil {
			return out, fmt.Errorf("reading %s rules: %w", o.name(), err)
		}
		if held {
			out = append(out, o)
		}
	}
	return out, nil
}

// VerifyPod reports how the pod's rules and policy route differ from what
// ApplyPod would install, including our rules left in another backend
// (no change; for nftables one netlink read, for iptables one save per
// family).
func (m *Manager) VerifyPod(ctx context.Context, podNS ns.NetNS, opts PodOptions) (Drift, error) {
	if err := ctx.Err(); err != nil {
		return Drift{}, err
	}
	if err := opts.Validate(); err != nil {
		return Drift{}, fmt.Errorf("verify pod rules: %w", err)
	}
	var d Drift
	err := inNS(podNS, "verify pod rules", func() error {
		rd, err := verifyPolicyRoute(m.cfg.IPv6)
		if err != nil {
			return err
		}
		d.add(rd)
		v := m.view()
		fd, err := m.be.verifyPod(ctx, opts, v)
		d.add(fd)
		if err != nil {
			return err
		}
		holding, err := m.othersHolding(ctx, v)
		for _, o := range holding {
			d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: our in-pod rules present in this backend too", o.name()))
		}
		if err != nil {
			return err
		}
		return nil
	})
	return d, err
}

// DeletePod removes exactly our chains (tables), jumps and policy route from
// podNS, in every backend that holds them, leaving built-in chains and anyone
// else's rules alone. Nothing of ours left is success.
func (m *Manager) DeletePod(ctx context.Context, podNS ns.NetNS) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return inNS(podNS, "delete pod rules", func() error {
		v := m.view()
		errs := []error{m.be.deletePod(ctx, v)}
		for _, o := range m.others {
			held, err := o.holdsPod(ctx, v)
			if err == nil && held {
				err = o.deletePod(ctx, v)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", o.name(), err))
			}
		}
		return errors.Join(append(errs, deletePolicyRoute())...)
	})
}

// WaitIdle waits until the netlink sockets the nftables backend releases in
// the background (see nftBackend.with) are closed, e.g. before exiting or
// when a test counts file descriptors. The manager stays usable.
func (m *Manager) WaitIdle() { m.bg.Wait() }
