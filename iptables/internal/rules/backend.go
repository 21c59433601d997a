package rules

import (
	"context"
	"errors"
	"net/netip"
)

// Backend programs the rule sets of one technology (iptables-restore of one
// variant with its ipsets, or nftables over netlink). Every method acts on
// the calling thread's network namespace: package iptables enters the pod's
// (or stays in the node's) before calling. The rule sets themselves are data
// (xtables.BuildPodRules, nftables.BuildPodRules, ...); a backend renders,
// applies, reads back and compares them.
type Backend interface {
	// Mode names the backend.
	Mode() Mode

	// The pod methods get the operation's View of the namespace's nftables
	// chains (nil when it could not be read: each backend then reads what
	// it needs itself).
	ApplyPod(ctx context.Context, opts PodOptions, v View) error
	VerifyPod(ctx context.Context, opts PodOptions, v View) (Drift, error)
	DeletePod(ctx context.Context, v View) error
	// HoldsPod reports, cheaply, whether any of our in-pod rules of this
	// backend exist here.
	HoldsPod(ctx context.Context, v View) (bool, error)

	EnsureHost(ctx context.Context) error
	VerifyHost(ctx context.Context) (Drift, error)
	DeleteHost(ctx context.Context) error
	// HoldsHost reports whether our host rules of this backend exist here
	// (v as for the pod methods).
	HoldsHost(ctx context.Context, v View) (bool, error)

	// Probes opens the probe-set store; close releases it.
	Probes() (store ProbeStore, close func(), err error)

	// Dump returns the live rules as the technology's own tool prints them
	// (iptables-save per family, `nft list ruleset`). It changes nothing.
	Dump(ctx context.Context) (string, error)
}

// View is one read of every nftables chain of a namespace, all families,
// shared by the backends of one operation (ours in inet; iptables-nft keeps
// its chains in ip and ip6) instead of each dumping them on a socket of its
// own. Package nftables reads it.
type View interface {
	// HasChain reports whether a chain named one of names exists in a table
	// of the nftables family nfproto (unix.NFPROTO_IPV4, ...).
	HasChain(nfproto uint8, names ...string) bool
}

// ProbeStore is the node's probe sets of one backend (ipsets or nftables
// sets): pod IP -> pod uid.
type ProbeStore interface {
	// List returns ip -> uid of f's set; an error wrapping ErrNoSet when
	// the set does not exist.
	List(f Family) (map[netip.Addr]string, error)
	// Add puts ip in f's set labelled uid; relabel says an entry with
	// another uid is present and must be replaced.
	Add(f Family, ip netip.Addr, uid string, relabel bool) error
	// Del removes ip from f's set.
	Del(f Family, ip netip.Addr) error
}

// ErrNoSet marks a probe set that does not exist.
var ErrNoSet = errors.New("probe set does not exist")

// IsNoSet reports whether err says a probe set does not exist.
func IsNoSet(err error) bool { return errors.Is(err, ErrNoSet) }

// SidecarBackend programs the sidecar rules (Istio's istio-cni sidecar
// mode) of one technology. Like Backend's pod methods, each acts on the
// calling thread's network namespace.
type SidecarBackend interface {
	// ApplySidecar makes the namespace's sidecar rules exactly o's; old,
	// when known, are the options the pod had (their rules in built-in
	// chains are removed too).
	ApplySidecar(ctx context.Context, o SidecarOptions, old *SidecarOptions, v View) error
	// VerifySidecar reports how the namespace's sidecar rules differ.
	VerifySidecar(ctx context.Context, o SidecarOptions, v View) (Drift, error)
	// DeleteSidecar removes every sidecar chain or table (and o's rules in
	// built-in chains, when o is known).
	DeleteSidecar(ctx context.Context, o *SidecarOptions, v View) error
	// HoldsSidecar reports, cheaply, whether sidecar rules of this
	// backend exist here.
	HoldsSidecar(ctx context.Context, v View) (bool, error)
}
