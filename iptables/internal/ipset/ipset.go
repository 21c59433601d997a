// Package ipset keeps the probe sets of the iptables backends: one ipset per
// address family (hash:ip, entry comment = pod uid) under Istio's names,
// created, verified, listed, changed and destroyed over netlink, no process
// spawned. The host rule that matches them is package xtables'.
//
// It may import only the bottom layer, iptables/internal/rules, of ambientd:
// never a sibling technology package (xtables, nftables), never package
// iptables, never Kubernetes.
package ipset

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Every function acts on the calling thread's network namespace (the
// node's, for the agent).

func family(f rules.Family) uint8 {
	if f == rules.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

func open() (*netlink.Handle, error) {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	return h, nil
}

// Create creates the probe sets of fams; an existing set of the same type
// is kept, entries and all.
func Create(fams []rules.Family) error {
	h, err := open()
	if err != nil {
		return err
	}
	defer h.Close()
	for _, f := range fams {
		err := h.IpsetCreate(f.ProbeSet(), "hash:ip", netlink.IpsetCreateOptions{
			Replace:  true, // no NLM_F_EXCL: an existing set of the same type is kept
			Comments: true,
			Family:   family(f),
		})
		if err != nil {
			return fmt.Errorf("creating ipset %s: %w", f.ProbeSet(), err)
		}
	}
	return nil
}

// Verify reports the probe sets of fams that are missing.
func Verify(fams []rules.Family) (rules.Drift, error) {
	var d rules.Drift
	h, err := open()
	if err != nil {
		return d, err
	}
	defer h.Close()
	for _, f := range fams {
		if _, err := h.IpsetList(f.ProbeSet()); errors.Is(err, unix.ENOENT) {
			d.Missing = append(d.Missing, "ipset create "+f.ProbeSet()+" hash:ip comment")
		} else if err != nil {
			return d, fmt.Errorf("listing ipset %s: %w", f.ProbeSet(), err)
		}
	}
	return d, nil
}

// Destroy destroys the probe sets of fams; absent is fine. A set still
// matched by a rule cannot go: remove the host rules first.
func Destroy(fams []rules.Family) error {
	h, err := open()
	if err != nil {
		return err
	}
	defer h.Close()
	for _, f := range fams {
		if err := h.IpsetDestroy(f.ProbeSet()); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("destroying ipset %s: %w", f.ProbeSet(), err)
		}
	}
	return nil
}

// Exist reports whether the probe set of any of fams exists.
func Exist(fams []rules.Family) (bool, error) {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return false, err
	}
	defer h.Close()
	for _, f := range fams {
		_, err := h.IpsetList(f.ProbeSet())
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, unix.ENOENT) {
			return false, err
		}
	}
	return false, nil
}

// Store is the probe sets as ipsets (hash:ip, comment = pod uid).
type Store struct{ h *netlink.Handle }

// Open opens the store; close releases it.
func Open() (rules.ProbeStore, func(), error) {
	h, err := open()
	if err != nil {
		return nil, nil, err
	}
	return Store{h}, h.Close, nil
}

func noSet(err error) error {
	if errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("%w: %w", rules.ErrNoSet, err)
	}
	return err
}

// Add puts ip in f's set with the comment uid, replacing an entry's comment
// (an ipset add with Replace needs no separate relabel).
func (s Store) Add(f rules.Family, ip netip.Addr, uid string, _ bool) error {
	e := &netlink.IPSetEntry{IP: net.IP(ip.AsSlice()), Comment: uid, Replace: true}
	if err := s.h.IpsetAdd(f.ProbeSet(), e); err != nil {
		return fmt.Errorf("adding %s (pod %s) to ipset %s: %w", ip, uid, f.ProbeSet(), noSet(err))
	}
	return nil
}

// Del removes ip from f's set.
func (s Store) Del(f rules.Family, ip netip.Addr) error {
	e := &netlink.IPSetEntry{IP: net.IP(ip.AsSlice())}
	if err := s.h.IpsetDel(f.ProbeSet(), e); err != nil {
		return fmt.Errorf("removing %s from ipset %s: %w", ip, f.ProbeSet(), noSet(err))
	}
	return nil
}

// List returns ip -> uid of f's set.
func (s Store) List(f rules.Family) (map[netip.Addr]string, error) {
	res, err := s.h.IpsetList(f.ProbeSet())
	if err != nil {
		return nil, fmt.Errorf("listing ipset %s: %w", f.ProbeSet(), noSet(err))
	}
	out := make(map[netip.Addr]string, len(res.Entries))
	for _, e := range res.Entries {
		a, ok := netip.AddrFromSlice(e.IP)
		if !ok {
			continue
		}
		out[a.Unmap()] = e.Comment
	}
	return out, nil
}
