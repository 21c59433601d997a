package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

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
// host rules, by EnsureHostRules. Each IP costs one write, whatever the
// size of the set: whether an entry must be relabelled comes from the
// manager's copy of the sets (see probeCache), re-read from the kernel when
// it is missing or a write based on it fails.
func (m *Manager) AddProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error {
	if uid == "" {
		return errors.New("add probe IPs: empty pod uid")
	}
	return m.withProbeSets(func(s rules.ProbeStore, c *probeCache) error {
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
			ip = ip.Unmap()
			set, err := c.set(s, f)
			if rules.IsNoSet(err) {
				if err = m.recreateHostRules(ctx, f); err == nil {
					set, err = c.fresh(f), nil
				}
			}
			if err != nil {
				return err
			}
			// Written even when the copy says it is there: an add is one
			// idempotent write, and re-asserts an entry lost behind our back.
			cur, ok := set[ip]
			if err := s.Add(f, ip, uid, ok && cur != uid); err != nil {
				return err
			}
			set[ip] = uid
		}
		return nil
	})
}

// probeCache is the probe sets (family → ip → uid) as this manager last
// read or wrote them in the network namespace netns (the node's): adding or
// removing one pod's entries needs no listing of the whole set, which grows
// with the node's pods. Only ambientd writes these sets; a copy gone stale
// behind its back (an entry deleted or relabelled by hand, a set
// recreated) makes a write fail, which drops the copy and retries from the
// kernel, or is put right by the drift pass's PruneProbeIPs, which always
// reads the kernel. Guarded by Manager.probeMu.
type probeCache struct {
	netns uint64
	sets  map[Family]map[netip.Addr]string
	// hit is set when an operation used a copy it did not read itself.
	hit bool
}

// set returns f's entries, from the copy or read from the kernel.
func (c *probeCache) set(s rules.ProbeStore, f Family) (map[netip.Addr]string, error) {
	if set, ok := c.sets[f]; ok {
		c.hit = true
		return set, nil
	}
	set, err := s.List(f)
	if err != nil {
		return nil, err
	}
	c.sets[f] = set
	return set, nil
}

// fresh records f's set as (re)created empty and returns it.
func (c *probeCache) fresh(f Family) map[netip.Addr]string {
	c.sets[f] = map[netip.Addr]string{}
	return c.sets[f]
}

// currentNetns is the inode of the calling thread's network namespace.
func currentNetns() (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		return 0, fmt.Errorf("reading the current network namespace: %w", err)
	}
	return st.Ino, nil
}

// withProbeSets runs fn with the backend's probe store and the probe-set
// copy, holding probeMu: the probe-set operations read then change, so they
// must not interleave (a removal could otherwise delete an entry an add
// just relabelled for another pod whose IP was reused). When fn fails
// after using a copy it did not read, the copy may be stale: it is dropped
// and fn runs once more against the kernel's sets (the writes are
// idempotent). A failure always drops the copy.
func (m *Manager) withProbeSets(fn func(rules.ProbeStore, *probeCache) error) error {
	m.probeMu.Lock()
	defer m.probeMu.Unlock()
	ino, err := currentNetns()
	if err != nil {
		return err
	}
	if m.probeCache == nil || m.probeCache.netns != ino {
		m.probeCache = &probeCache{netns: ino, sets: map[Family]map[netip.Addr]string{}}
	}
	s, closeFn, err := m.be.Probes()
	if err != nil {
		return err
	}
	defer closeFn()
	c := m.probeCache
	c.hit = false
	err = fn(s, c)
	if err != nil && c.hit {
		c = &probeCache{netns: ino, sets: map[Family]map[netip.Addr]string{}}
		m.probeCache = c
		err = fn(s, c)
	}
	if err != nil {
		m.probeCache = nil
	}
	return err
}

// dropProbeCache forgets the probe-set copy (the sets were created,
// recreated or destroyed).
func (m *Manager) dropProbeCache() {
	m.probeMu.Lock()
	m.probeCache = nil
	m.probeMu.Unlock()
}

// recreateHostRules restores the probe sets and SNAT rules after f's set
// was found gone (someone else removed the host rules).
func (m *Manager) recreateHostRules(ctx context.Context, f Family) error {
	m.log.Warn("probe set missing; recreating it and the host probe rules", "set", f.ProbeSet(), "backend", string(m.mode))
	return m.be.EnsureHost(ctx)
}

// RemoveProbeIPs removes those of ips whose entry comment is uid; an entry
// that now belongs to another pod (its IP was reused) is left alone. A set
// that does not exist holds nothing to remove. Every IP is tried; the errors
// are joined.
func (m *Manager) RemoveProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error {
	return m.withProbeSets(func(s rules.ProbeStore, c *probeCache) error {
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
			set, err := c.set(s, f)
			switch {
			case rules.IsNoSet(err):
				set = c.fresh(f)
			case err != nil:
				errs = append(errs, err)
				continue
			}
			ip = ip.Unmap()
			if cur, ok := set[ip]; !ok || cur != uid {
				continue
			}
			if err := s.Del(f, ip); err != nil && !rules.IsNoSet(err) {
				errs = append(errs, err)
				continue
			}
			delete(set, ip)
		}
		return errors.Join(errs...)
	})
}

// ProbeChanges counts what PruneProbeIPs changed in the probe sets.
type ProbeChanges struct {
	Added, Relabelled, Removed int
}

// Total is the number of entries changed.
func (p ProbeChanges) Total() int { return p.Added + p.Relabelled + p.Removed }

// PruneProbeIPs makes the probe sets equal to live (uid -> IPs) by
// difference: entries of pods not in live are removed, missing ones added,
// entries with another uid re-labelled; it reports how many of each. Live
// entries are never removed, so probes keep working during the prune. It
// always reads the kernel's sets (the drift pass's check of them), and
// leaves the manager's copy equal to the result.
func (m *Manager) PruneProbeIPs(ctx context.Context, live map[string][]netip.Addr) (ProbeChanges, error) {
	var ch ProbeChanges
	err := m.withProbeSets(func(s rules.ProbeStore, c *probeCache) error {
		ch = ProbeChanges{}
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
			delete(c.sets, f) // read the kernel, never the copy
			have, err := c.set(s, f)
			if rules.IsNoSet(err) {
				if err = m.recreateHostRules(ctx, f); err == nil {
					have, err = c.fresh(f), nil
				}
			}
			if err != nil {
				return err
			}
			for ip := range have {
				if _, ok := want[f][ip]; !ok {
					if err := s.Del(f, ip); err != nil {
						return err
					}
					delete(have, ip)
					ch.Removed++
				}
			}
			for ip, uid := range want[f] {
				if err := ctx.Err(); err != nil {
					return err
				}
				cur, ok := have[ip]
				if ok && cur == uid {
					continue
				}
				if err := s.Add(f, ip, uid, ok); err != nil {
					return err
				}
				have[ip] = uid
				if ok {
					ch.Relabelled++
				} else {
					ch.Added++
				}
			}
		}
		return nil
	})
	return ch, err
}
