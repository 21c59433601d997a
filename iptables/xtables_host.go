package iptables

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Host side of the iptables backends: ipsets over netlink, ISTIO_POSTRT
// jumped from the first position of nat POSTROUTING (as Istio inserts it
// since 1.27, so an earlier terminal rule cannot pre-empt the probe SNAT).

func (x *xtables) ensureHost(ctx context.Context) error {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	for _, f := range x.families() {
		err := h.IpsetCreate(f.probeSet(), "hash:ip", netlink.IpsetCreateOptions{
			Replace:  true, // no NLM_F_EXCL: an existing set of the same type is kept
			Comments: true,
			Family:   ipsetFamily(f),
		})
		if err != nil {
			return fmt.Errorf("creating ipset %s: %w", f.probeSet(), err)
		}
	}
	if err := x.apply(ctx, BuildHostRules(x.cfg)); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	return nil
}

func (x *xtables) verifyHost(ctx context.Context) (Drift, error) {
	var d Drift
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return d, fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	for _, f := range x.families() {
		if _, err := h.IpsetList(f.probeSet()); errors.Is(err, unix.ENOENT) {
			d.Missing = append(d.Missing, "ipset create "+f.probeSet()+" hash:ip comment")
		} else if err != nil {
			return d, fmt.Errorf("listing ipset %s: %w", f.probeSet(), err)
		}
	}
	rd, err := x.verify(ctx, BuildHostRules(x.cfg))
	d.add(rd)
	return d, err
}

func (x *xtables) deleteHost(ctx context.Context) error {
	if err := x.remove(ctx, BuildHostRules(x.cfg)); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	for _, f := range x.families() {
		if err := h.IpsetDestroy(f.probeSet()); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("destroying ipset %s: %w", f.probeSet(), err)
		}
	}
	return nil
}

// holdsHost: our host chain in this variant, or (for legacy, which ipsets
// belong to as much as to iptables-nft) a probe ipset on the node.
func (x *xtables) holdsHost(ctx context.Context) (bool, error) {
	return x.holds(ctx, nil, ChainPostrouting)
}

func ipsetFamily(f Family) uint8 {
	if f == IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// ipsetStore is the probe sets as ipsets (hash:ip, comment = pod uid).
type ipsetStore struct{ h *netlink.Handle }

func (x *xtables) probes() (probeStore, func(), error) {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	return ipsetStore{h}, h.Close, nil
}

func (s ipsetStore) add(f Family, ip netip.Addr, uid string, _ bool) error {
	e := &netlink.IPSetEntry{IP: net.IP(ip.AsSlice()), Comment: uid, Replace: true}
	if err := s.h.IpsetAdd(f.probeSet(), e); err != nil {
		if errors.Is(err, unix.ENOENT) {
			err = fmt.Errorf("%w: %w", errNoSet, err)
		}
		return fmt.Errorf("adding %s (pod %s) to ipset %s: %w", ip, uid, f.probeSet(), err)
	}
	return nil
}

func (s ipsetStore) del(f Family, ip netip.Addr) error {
	e := &netlink.IPSetEntry{IP: net.IP(ip.AsSlice())}
	if err := s.h.IpsetDel(f.probeSet(), e); err != nil {
		if errors.Is(err, unix.ENOENT) {
			err = fmt.Errorf("%w: %w", errNoSet, err)
		}
		return fmt.Errorf("removing %s from ipset %s: %w", ip, f.probeSet(), err)
	}
	return nil
}

func (s ipsetStore) list(f Family) (map[netip.Addr]string, error) {
	res, err := s.h.IpsetList(f.probeSet())
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			err = fmt.Errorf("%w: %w", errNoSet, err)
		}
		return nil, fmt.Errorf("listing ipset %s: %w", f.probeSet(), err)
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
