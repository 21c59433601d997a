package iptables

import (
	"errors"
	"fmt"
	"time"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// Mode selects the rule backend.
type Mode = rules.Mode

const (
	// ModeAuto keeps the backend chosen before (persisted in StateDir),
	// else the one already holding our host rules, else nftables where the
	// kernel supports it, else the iptables variant holding more rules.
	ModeAuto Mode = "auto"
	// ModeLegacy and ModeNFT are iptables-restore batches of the legacy and
	// the nf_tables variant of the iptables tools.
	ModeLegacy = rules.ModeLegacy
	ModeNFT    = rules.ModeNFT
	// ModeNFTables is native nftables over netlink (Istio's nft layout), no
	// process spawned.
	ModeNFTables = rules.ModeNFTables
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

// Validate checks the config, naming what is wrong (an operator's
// setting by its flag, RegisterFlags).
func (c Config) Validate() error {
	if _, err := ParseMode(string(c.Mode)); err != nil {
		return fmt.Errorf("--iptables: %w", err)
	}
	for _, i := range c.RerouteInterfaces {
		if err := ValidInterfaceName(i); err != nil {
			return err
		}
	}
	// 0 is the default; more than a minute holds every rule step of the
	// node that long behind another program's lock.
	if c.LockWait < 0 || c.LockWait > time.Minute {
		return fmt.Errorf("--iptables-lock-wait %v: want 0 (the default, %v) or up to 1m", c.LockWait, DefaultLockWait)
	}
	if c.Timeout < 0 {
		return errors.New("iptables timeout must not be negative")
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Mode == "" {
		c.Mode = ModeAuto
	}
	if c.LockWait == 0 {
		c.LockWait = DefaultLockWait
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.HostProc == "" {
		c.HostProc = "/proc"
	}
	return c
}

// node is what every backend renders rule sets from.
func (c Config) node() rules.Node {
	return rules.Node{IPv6: c.IPv6, RerouteInterfaces: c.RerouteInterfaces}
}

func (c Config) xtables(m *Manager) xtables.Config {
	return xtables.Config{Node: c.node(), LockWait: c.LockWait, Timeout: c.Timeout, Spawned: &m.spawned}
}

func (c Config) nftables() nftables.Config {
	return nftables.Config{Node: c.node(), KubeletUID: c.KubeletUID, HostProc: c.HostProc}
}
