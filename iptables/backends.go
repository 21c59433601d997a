package iptables

import (
	"context"

	"github.com/ambientd/ambientd/iptables/internal/ipset"
	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// newBackend builds the backend of mode. primary: the families the config
// programs must all be available (and the version is logged); otherwise
// (another backend, only cleaned up) whatever families exist.
func (m *Manager) newBackend(ctx context.Context, mode Mode, primary bool) (rules.Backend, error) {
	if mode == ModeNFTables {
		return nftables.New(ctx, m.cfg.nftables(), m.log, &m.bg, primary)
	}
	x, err := xtables.New(m.cfg.xtables(m), m.log, mode, primary)
	if err != nil {
		return nil, err
	}
	return iptablesBackend{x}, nil
}

// iptablesBackend is one variant of the iptables tools: its rules (package
// xtables) and the probe ipsets its host rule matches (package ipset),
// created before the rules and destroyed after them.
type iptablesBackend struct{ *xtables.Backend }

func (b iptablesBackend) EnsureHost(ctx context.Context) error {
	if err := ipset.Create(b.Families()); err != nil {
		return err
	}
	return b.Backend.EnsureHost(ctx)
}

func (b iptablesBackend) VerifyHost(ctx context.Context) (Drift, error) {
	d, err := ipset.Verify(b.Families())
	if err != nil {
		return d, err
	}
	rd, err := b.Backend.VerifyHost(ctx)
	d.Add(rd)
	return d, err
}

func (b iptablesBackend) DeleteHost(ctx context.Context) error {
	if err := b.Backend.DeleteHost(ctx); err != nil {
		return err
	}
	return ipset.Destroy(b.Families())
}

func (b iptablesBackend) Probes() (rules.ProbeStore, func(), error) { return ipset.Open() }
