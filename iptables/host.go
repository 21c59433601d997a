package iptables

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Host side: these act on the calling goroutine's network namespace, which
// for the agent is the node's.

// EnsureHostRules creates the probe ipsets (kept when present, entries and
// all) and installs the probe SNAT chain ISTIO_POSTRT, jumped from nat
// POSTROUTING, per family. Idempotent.
func (m *Manager) EnsureHostRules(ctx context.Context) error {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	for _, f := range m.families() {
		err := h.IpsetCreate(f.probeSet(), "hash:ip", netlink.IpsetCreateOptions{
			Replace:  true, // no NLM_F_EXCL: an existing set of the same type is kept
			Comments: true,
			Family:   ipsetFamily(f),
		})
		if err != nil {
			return fmt.Errorf("creating ipset %s: %w", f.probeSet(), err)
		}
	}
	if err := m.apply(ctx, BuildHostRules(m.cfg)); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	return nil
}

// DeleteHostRules removes ISTIO_POSTRT and its jump, then the probe ipsets.
// Absent is fine.
func (m *Manager) DeleteHostRules(ctx context.Context) error {
	if err := m.remove(ctx, BuildHostRules(m.cfg)); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	for _, f := range m.families() {
		if err := h.IpsetDestroy(f.probeSet()); err != nil && !isNoSet(err) {
			return fmt.Errorf("destroying ipset %s: %w", f.probeSet(), err)
		}
	}
	return nil
}

func isNoSet(err error) bool {
	return errors.Is(err, unix.ENOENT)
}

func ipsetFamily(f Family) uint8 {
	if f == IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// errFamilyOff marks an address of a family this manager does not program
// (IPv6 with IPv6 off): a dual-stack pod's IPv6 address is skipped, not an
// error, since no probe rule of that family exists either.
var errFamilyOff = errors.New("address family not enabled")

func (m *Manager) familyOf(a netip.Addr) (Family, error) {
	a = a.Unmap()
	switch {
	case !a.IsValid():
		return 0, errors.New("invalid IP address")
	case a.Is4():
		return IPv4, nil
	case !m.cfg.IPv6:
		return 0, fmt.Errorf("IPv6 address %s: %w", a, errFamilyOff)
	}
	return IPv6, nil
}

// AddProbeIPs adds the pod's IPs to the probe sets with the uid as comment.
// An entry already present is kept and its comment set to uid.
// A set that is gone (destroyed behind our back) is recreated, with the
// host rules, by EnsureHostRules.
func (m *Manager) AddProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error {
	if uid == "" {
		return errors.New("add probe IPs: empty pod uid")
	}
	return m.withProbeSets(func(h *netlink.Handle) error {
		for _, ip := range ips {
			if err := ctx.Err(); err != nil {
				return err
			}
			f, err := m.familyOf(ip)
			if errors.Is(err, errFamilyOff) {
				continue
			}
			if err != nil {
				return fmt.Errorf("add probe IP for pod %s: %w", uid, err)
			}
			err = addEntry(h, f, ip.Unmap(), uid)
			if isNoSet(err) {
				if err = m.recreateHostRules(ctx, f); err == nil {
					err = addEntry(h, f, ip.Unmap(), uid)
				}
			}
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// withProbeSets runs fn with a netfilter netlink handle, holding probeMu: the
// probe-set operations list then change, so they must not interleave (a
// removal could otherwise delete an entry an add just relabelled for another
// pod whose IP was reused).
func (m *Manager) withProbeSets(fn func(h *netlink.Handle) error) error {
	m.probeMu.Lock()
	defer m.probeMu.Unlock()
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	return fn(h)
}

func addEntry(h *netlink.Handle, f Family, ip netip.Addr, uid string) error {
	e := &netlink.IPSetEntry{IP: net.IP(ip.AsSlice()), Comment: uid, Replace: true}
	if err := h.IpsetAdd(f.probeSet(), e); err != nil {
		return fmt.Errorf("adding %s (pod %s) to ipset %s: %w", ip, uid, f.probeSet(), err)
	}
	return nil
}

func delEntry(h *netlink.Handle, f Family, ip netip.Addr) error {
	e := &netlink.IPSetEntry{IP: net.IP(ip.AsSlice())}
	if err := h.IpsetDel(f.probeSet(), e); err != nil {
		return fmt.Errorf("removing %s from ipset %s: %w", ip, f.probeSet(), err)
	}
	return nil
}

// listSet returns ip -> comment of one probe set.
func listSet(h *netlink.Handle, f Family) (map[netip.Addr]string, error) {
	res, err := h.IpsetList(f.probeSet())
	if err != nil {
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

// recreateHostRules restores the probe sets and SNAT rules after f's set
// was found gone (someone else removed the host rules).
func (m *Manager) recreateHostRules(ctx context.Context, f Family) error {
	m.log.Warn("probe ipset missing; recreating it and the host probe rules", "set", f.probeSet())
	return m.EnsureHostRules(ctx)
}

// RemoveProbeIPs removes those of ips whose entry comment is uid; an entry
// that now belongs to another pod (its IP was reused) is left alone. A set
// that does not exist holds nothing to remove. Every IP is tried; the errors
// are joined.
func (m *Manager) RemoveProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error {
	return m.withProbeSets(func(h *netlink.Handle) error {
		sets := map[Family]map[netip.Addr]string{}
		var errs []error
		for _, ip := range ips {
			if err := ctx.Err(); err != nil {
				return errors.Join(append(errs, err)...)
			}
			f, err := m.familyOf(ip)
			if errors.Is(err, errFamilyOff) {
				continue
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("remove probe IP for pod %s: %w", uid, err))
				continue
			}
			if sets[f] == nil {
				set, err := listSet(h, f)
				switch {
				case isNoSet(err):
					set = map[netip.Addr]string{}
				case err != nil:
					errs = append(errs, err)
					continue
				}
				sets[f] = set
			}
			ip = ip.Unmap()
			if c, ok := sets[f][ip]; !ok || c != uid {
				continue
			}
			if err := delEntry(h, f, ip); err != nil && !isNoSet(err) {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
}

// PruneProbeIPs makes the probe sets equal to live (uid -> IPs) by
// difference: entries of pods not in live are removed, missing ones added,
// entries with another uid re-labelled. Live entries are never removed, so
// probes keep working during the prune.
func (m *Manager) PruneProbeIPs(ctx context.Context, live map[string][]netip.Addr) error {
	return m.withProbeSets(func(h *netlink.Handle) error {
		want := map[Family]map[netip.Addr]string{}
		for _, f := range m.families() {
			want[f] = map[netip.Addr]string{}
		}
		uids := make([]string, 0, len(live))
		for uid := range live {
			uids = append(uids, uid)
		}
		slices.Sort(uids) // an IP listed under two uids goes to the first, every time
		for _, uid := range uids {
			for _, ip := range live[uid] {
				f, err := m.familyOf(ip)
				if errors.Is(err, errFamilyOff) {
					continue
				}
				if err != nil {
					return fmt.Errorf("prune probe IPs, pod %s: %w", uid, err)
				}
				if _, dup := want[f][ip.Unmap()]; !dup {
					want[f][ip.Unmap()] = uid
				}
			}
		}
		for _, f := range m.families() {
			have, err := listSet(h, f)
			if isNoSet(err) {
				if err = m.recreateHostRules(ctx, f); err == nil {
					have = map[netip.Addr]string{}
				}
			}
			if err != nil {
				return err
			}
			for ip := range have {
				if _, ok := want[f][ip]; !ok {
					if err := delEntry(h, f, ip); err != nil {
						return err
					}
				}
			}
			for ip, uid := range want[f] {
				if err := ctx.Err(); err != nil {
					return err
				}
				if c, ok := have[ip]; ok && c == uid {
					continue
				}
				if err := addEntry(h, f, ip, uid); err != nil {
					return err
				}
			}
		}
		return nil
	})
}
