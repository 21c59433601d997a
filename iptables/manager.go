package iptables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Manager applies, verifies and deletes rule sets with the backend chosen
// once at construction. It holds no per-pod state and is safe for
// concurrent use.
type Manager struct {
	cfg  Config
	log  *slog.Logger
	mode Mode
	be   rules.Backend
	// others are the other backends whose tools exist: a pod or node may
	// hold our rules there (the backend changed, or Istio's agent used
	// another one), so delete removes them, verify reports them and apply
	// moves the pod onto be.
	others []rules.Backend
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
			log.Debug("other rule backend unavailable", "backend", string(other), "error", err)
		}
	}
	if err := m.persist(); err != nil {
		return nil, err
	}
	return m, nil
}

// Mode returns the resolved backend (legacy, nft or nftables).
func (m *Manager) Mode() Mode { return m.mode }

// Config returns the manager's config with defaults filled in.
func (m *Manager) Config() Config { return m.cfg }

func (m *Manager) families() []Family { return rules.Families(m.cfg.IPv6) }

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
		v, done := m.view()
		defer done()
		if err := m.be.ApplyPod(ctx, opts, v); err != nil {
			return err
		}
		holding, err := m.othersHolding(ctx, v)
		for _, o := range holding {
			m.log.Info("removing our rules of another backend from the pod", "backend", string(o.Mode()), "netns", podNS.Path())
			if err := o.DeletePod(ctx, v); err != nil {
				return fmt.Errorf("removing %s rules: %w", o.Mode(), err)
			}
		}
		return err
	})
}

// view reads the namespace's nftables chains once for the operation (the
// nftables backend goes on using its socket); nil (each backend reads for
// itself) when that fails, e.g. on a kernel without nf_tables under the
// legacy backend. done releases it.
func (m *Manager) view() (v rules.View, done func()) {
	nv, err := nftables.ReadView(&m.bg)
	if err != nil {
		m.log.Debug("nftables chains unreadable", "error", err)
		return nil, func() {}
	}
	return nv, nv.Close
}

// othersHolding returns the other backends that hold in-pod rules of ours in
// the current namespace.
func (m *Manager) othersHolding(ctx context.Context, v rules.View) ([]rules.Backend, error) {
	var out []rules.Backend
	for _, o := range m.others {
		held, err := o.HoldsPod(ctx, v)
		if err != nil {
			return out, fmt.Errorf("reading %s rules: %w", o.Mode(), err)
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
		d.Add(rd)
		v, done := m.view()
		defer done()
		fd, err := m.be.VerifyPod(ctx, opts, v)
		d.Add(fd)
		if err != nil {
			return err
		}
		holding, err := m.othersHolding(ctx, v)
		for _, o := range holding {
			d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: our in-pod rules present in this backend too", o.Mode()))
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
		v, done := m.view()
		defer done()
		errs := []error{m.be.DeletePod(ctx, v)}
		for _, o := range m.others {
			held, err := o.HoldsPod(ctx, v)
			if err == nil && held {
				err = o.DeletePod(ctx, v)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", o.Mode(), err))
			}
		}
		return errors.Join(append(errs, deletePolicyRoute())...)
	})
}

// WaitIdle waits until the netlink sockets the nftables backend releases in
// the background are closed, e.g. before exiting or when a test counts file
// descriptors. The manager stays usable.
func (m *Manager) WaitIdle() { m.bg.Wait() }
