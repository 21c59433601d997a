package xtables

import (
	"context"
	"fmt"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Host side: ISTIO_POSTRT jumped from the first position of nat POSTROUTING
// (as Istio inserts it since 1.27, so an earlier terminal rule cannot
// pre-empt the probe SNAT). The probe ipsets the rule matches are package
// ipset's: the caller creates them before EnsureHost and destroys them after
// DeleteHost.

// EnsureHost installs the host rules (see apply).
func (b *Backend) EnsureHost(ctx context.Context) error {
	if err := b.apply(ctx, BuildHostRules(b.cfg.Node)); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	return nil
}

// VerifyHost reports how the host rules differ (one save per family).
func (b *Backend) VerifyHost(ctx context.Context) (rules.Drift, error) {
	return b.verify(ctx, BuildHostRules(b.cfg.Node))
}

// DeleteHost removes the host chain and its jump.
func (b *Backend) DeleteHost(ctx context.Context) error {
	if err := b.remove(ctx, BuildHostRules(b.cfg.Node)); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	return nil
}

// HoldsHost reports whether our host chain exists in this variant (v as
// for HoldsPod).
func (b *Backend) HoldsHost(ctx context.Context, v rules.View) (bool, error) {
	return b.holds(ctx, v, ChainPostrouting)
}
