package iptables

import (
	"context"
	"errors"
	"net/netip"
)

// backend programs rule sets of one technology (iptables-restore of one
// variant, or nftables over netlink). Every method acts on the calling
// thread's network namespace: the Manager enters the pod's (or stays in the
// node's) before calling. The rule sets themselves are data (BuildPodRules,
// BuildPodRulesNFT, ...); a backend renders, applies, reads back and
// compares them.
type backend interface {
	name() Mode

	// The pod methods get the operation's view of the namespace's nftables
	// chains (nil when it could not be read: each backend then reads what
	// it needs itself).
	applyPod(ctx context.Context, opts PodOptions, v *nsView) error
	verifyPod(ctx context.Context, opts PodOptions, v *nsView) (Drift, error)
	deletePod(ctx context.Context, v *nsView) error
	// holdsPod reports, cheaply, whether any of our in-pod rules of this
	// backend exist here.
	holdsPod(ctx context.Context, v *nsView) (bool, error)

	ensureHost(ctx context.Context) error
	verifyHost(ctx context.Context) (Drift, error)
	deleteHost(ctx context.Context) error
	// holdsHost reports whether our host rules (or probe sets) of this
	// backend exist here.
	holdsHost(ctx context.Context) (bool, error)

	// probes opens the probe-set store; close releases it.
	probes() (store probeStore, close func(), err error)
}

// probeStore is the node's probe sets of one backend (ipsets or nftables
// sets): pod IP -> pod uid.
type probeStore interface {
	// list returns ip -> uid of f's set; an error wrapping errNoSet when the
	// set does not exist.
	list(f Family) (map[netip.Addr]string, error)
	// add puts ip in f's set labelled uid; relabel says an entry with
	// another uid is present and must be replaced.
	add(f Family, ip netip.Addr, uid string, relabel bool) error
	// del removes ip from f's set.
	del(f Family, ip netip.Addr) error
}

// errNoSet marks a probe set that does not exist.
var errNoSet = errors.New("probe set does not exist")

func isNoSet(err error) bool { return errors.Is(err, errNoSet) }
