package iptables

import (
	"context"
	"slices"

	"github.com/ambientd/ambientd/iptables/internal/ipset"
	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// choose resolves ModeAuto in the current (node) namespace.
func (m *Manager) choose(ctx context.Context) (Mode, error) {
	if mode, err := m.readState(); err != nil || mode != "" {
		if mode != "" {
			m.log.Info("rule backend kept from state", "mode", string(mode), "dir", m.cfg.StateDir)
		}
		return mode, err
	}
	// Whichever backend already holds our host rules wins (restart after a
	// lost state file, or a node Istio's agent set up).
	var holders []Mode
	v, done := m.view()
	defer done()
	for _, mode := range []Mode{ModeLegacy, ModeNFT, ModeNFTables} {
		b, err := m.newBackend(ctx, mode, false)
		if err != nil {
			continue
		}
		held, err := b.HoldsHost(ctx, v)
		if err != nil {
			m.log.Debug("rule backend unreadable", "backend", string(mode), "error", err)
			continue
		}
		if held {
			holders = append(holders, mode)
		}
	}
	probeIPSets, err := ipset.Exist([]Family{IPv4, IPv6})
	if err != nil {
		m.log.Debug("ipsets unreadable", "error", err)
	}
	switch {
	case slices.Contains(holders, ModeLegacy) && slices.Contains(holders, ModeNFT):
		mode, err := m.detect(ctx)
		m.log.Info("our host rules exist in both iptables variants; following the one with more rules", "mode", string(mode))
		return mode, err
	case slices.Contains(holders, ModeLegacy):
		m.log.Info("rule backend: our host rules exist in iptables-legacy", "mode", string(ModeLegacy))
		return ModeLegacy, nil
	case slices.Contains(holders, ModeNFT):
		m.log.Info("rule backend: our host rules exist in iptables-nft", "mode", string(ModeNFT))
		return ModeNFT, nil
	case probeIPSets:
		// iptables-mode probe sets without rules: stay on iptables until the
		// node is clean (Istio's migration rule).
		mode, err := m.detect(ctx)
		m.log.Info("rule backend: probe ipsets of the iptables mode exist; staying on iptables", "mode", string(mode))
		return mode, err
	case slices.Contains(holders, ModeNFTables):
		m.log.Info("rule backend: our host rules exist in nftables", "mode", string(ModeNFTables))
		return ModeNFTables, nil
	}
	if err := nftables.Supported(); err != nil {
		m.log.Info("nftables backend not usable on this kernel; using iptables", "error", err)
		return m.detect(ctx)
	}
	m.log.Info("rule backend: clean node, kernel supports nftables", "mode", string(ModeNFTables))
	return ModeNFTables, nil
}

// detect counts the rules each iptables variant holds in the current
// namespace and picks the one with more, nft on a tie (as the Kubernetes
// iptables-wrapper does), so the agent joins whatever kubelet and kube-proxy
// already use.
func (m *Manager) detect(ctx context.Context) (Mode, error) {
	count := map[Mode]int{}
	for _, mode := range []Mode{ModeLegacy, ModeNFT} {
		for _, f := range m.families() {
			n, err := xtables.CountRules(ctx, m.cfg.xtables(m), mode, f)
			if err != nil {
				m.log.Debug("iptables variant unavailable or unreadable", "mode", string(mode), "error", err)
				continue
			}
			count[mode] += n
		}
	}
	mode := ModeNFT
	if count[ModeLegacy] > count[ModeNFT] {
		mode = ModeLegacy
	}
	m.log.Info("iptables mode detected", "mode", string(mode), "legacy_rules", count[ModeLegacy], "nft_rules", count[ModeNFT])
	return mode, nil
}
