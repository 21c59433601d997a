package iptables

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The backend choice is sticky: once made on a node it is kept across
// restarts (persisted in StateDir, keyed by the node's network namespace),
// so the rules are never split over two backends. Migration follows Istio's
// rule: stay on the current backend until the node is clean (no host rules
// or probe sets of ours in it — after a reboot, or DeleteHostRules with all
// pods removed).

// stateFile is the file in StateDir holding the chosen backend.
const stateFile = "rules-backend"

// netnsID identifies the calling thread's network namespace (its inode), so
// a state file written for another namespace (another node sharing the
// directory, as tests do) is not followed.
func netnsID() (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		return "", fmt.Errorf("reading network namespace: %w", err)
	}
	return strconv.FormatUint(st.Ino, 10), nil
}

// readState returns the persisted backend for this namespace, or "".
func (m *Manager) readState() (Mode, error) {
	if m.cfg.StateDir == "" {
		return "", nil
	}
	path := filepath.Join(m.cfg.StateDir, stateFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	id, err := netnsID()
	if err != nil {
		return "", err
	}
	fields := strings.Fields(string(b))
	if len(fields) != 2 || fields[1] != "netns="+id {
		m.log.Info("rule backend state is for another network namespace; ignored", "file", path, "content", strings.TrimSpace(string(b)))
		return "", nil
	}
	mode, err := ParseMode(fields[0])
	if err != nil || mode == ModeAuto {
		m.log.Warn("rule backend state unreadable; ignored", "file", path, "content", strings.TrimSpace(string(b)))
		return "", nil
	}
	return mode, nil
}

// persist records the chosen backend (atomically: write then rename).
func (m *Manager) persist() error {
	if m.cfg.StateDir == "" {
		return nil
	}
	id, err := netnsID()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(m.cfg.StateDir, 0o755); err != nil {
		return fmt.Errorf("rule backend state dir: %w", err)
	}
	path := filepath.Join(m.cfg.StateDir, stateFile)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(string(m.mode)+" netns="+id+"\n"), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

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
	for _, mode := range []Mode{ModeLegacy, ModeNFT, ModeNFTables} {
		b, err := m.newBackend(ctx, mode, false)
		if err != nil {
			continue
		}
		held, err := b.holdsHost(ctx)
		if err != nil {
			m.log.Debug("rule backend unreadable", "backend", string(mode), "err", err)
			continue
		}
		if held {
			holders = append(holders, mode)
		}
	}
	probeIPSets, err := probeIPSetsExist()
	if err != nil {
		m.log.Debug("ipsets unreadable", "err", err)
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
	if err := nftablesSupported(); err != nil {
		m.log.Info("nftables backend not usable on this kernel; using iptables", "err", err)
		return m.detect(ctx)
	}
	m.log.Info("rule backend: clean node, kernel supports nftables", "mode", string(ModeNFTables))
	return ModeNFTables, nil
}

// probeIPSetsExist reports whether the iptables mode's probe ipsets exist.
func probeIPSetsExist() (bool, error) {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return false, err
	}
	defer h.Close()
	for _, f := range []Family{IPv4, IPv6} {
		_, err := h.IpsetList(f.probeSet())
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, unix.ENOENT) {
			return false, err
		}
	}
	return false, nil
}

// detect counts the rules each iptables variant holds in the current
// namespace and picks the one with more, nft on a tie (as the Kubernetes
// iptables-wrapper does), so the agent joins whatever kubelet and kube-proxy
// already use.
func (m *Manager) detect(ctx context.Context) (Mode, error) {
	count := map[Mode]int{}
	for _, mode := range []Mode{ModeLegacy, ModeNFT} {
		for _, f := range m.families() {
			t, err := lookTools(f, mode)
			if err != nil {
				m.log.Debug("iptables variant unavailable", "mode", string(mode), "err", err)
				continue
			}
			x := &xtables{cfg: m.cfg, log: m.log, mode: mode, tools: map[Family]tools{f: t}, spawned: &m.spawned, bg: &m.bg}
			out, err := x.run(ctx, t.save, nil)
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
