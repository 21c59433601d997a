package iptables

import (
	"context"
	"fmt"
)

// Host side: these act on the calling goroutine's network namespace, which
// for the agent is the node's.

// EnsureHostRules creates the probe sets (kept when present, entries and
// all) and installs the probe SNAT rules of the chosen backend. Idempotent:
// on a node whose host rules are intact (ours, or the same ones Istio's agent
// set up) it changes nothing.
func (m *Manager) EnsureHostRules(ctx context.Context) error {
	defer m.dropProbeCache()
	return m.be.EnsureHost(ctx)
}

// VerifyHostRules reports how the node's probe sets and SNAT rules differ
// from what EnsureHostRules installs, changing nothing.
func (m *Manager) VerifyHostRules(ctx context.Context) (Drift, error) {
	if err := ctx.Err(); err != nil {
		return Drift{}, err
	}
	return m.be.VerifyHost(ctx)
}

// RepairHostRules is the drift pass's host step: it verifies the host rules
// and, only when they differ, re-asserts them (a firewalld reload or a rule
// deleted by hand). It returns the drift it repaired; an empty Drift means
// nothing was touched.
func (m *Manager) RepairHostRules(ctx context.Context) (Drift, error) {
	d, err := m.VerifyHostRules(ctx)
	if err != nil || d.Empty() {
		return d, err
	}
	m.log.Warn("host probe rules drifted; repairing", "backend", string(m.mode), "drift", d.String())
	defer m.dropProbeCache()
	if err := m.be.EnsureHost(ctx); err != nil {
		return d, fmt.Errorf("repairing host rules: %w", err)
	}
	return d, nil
}

// DeleteHostRules removes the probe SNAT rules, then the probe sets. Absent
// is fine.
func (m *Manager) DeleteHostRules(ctx context.Context) error {
	defer m.dropProbeCache()
	return m.be.DeleteHost(ctx)
}
