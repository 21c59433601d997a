package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// Host side: these act on the calling goroutine's network namespace, which
// for the agent is the node's.

// EnsureHostRules creates the probe sets (kept when present, entries and
// all) and installs the probe SNAT rules of the chosen backend. Idempotent:
// on a node whose host rules are intact (ours, or the same ones Istio's agent
// set up) it changes nothing.
func (m *Manager) EnsureHostRules(ctx context.Context) error {
	return m.be.ensureHost(ctx)
}

// VerifyHostRules reports how the node's probe sets and SNAT rules differ
// from what EnsureHostRules installs, changing nothing.
func (m *Manager) VerifyHostRules(ctx context.Context) (Drift, error) {
	if err := ctx.Err(); err != nil {
		return Drift{}, err
	}
	return m.be.verifyHost(ctx)
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
	if err := m.be.ensureHost(ctx); err != nil {
		return d, fmt.Errorf("repairing host rules: %w", err)
	}
	return d, nil
}

// DeleteHostRules removes the probe SNAT rules, then the probe sets. Absent
// is fine.
func (m *Manager) DeleteHostRules(ctx context.Context) error {
	return m.be.deleteHost(ctx)
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
	return m.withProbeSets(func(s probeStore) error {
		sets := map[Family]map[netip.Addr]string{}
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
			if sets[f] == nil {
				set, err := s.list(f)
				if isNoSet(err) {
					if err = m.recreateHostRules(ctx, f); err == nil {
						set, err = map[netip.Addr]string{}, nil
					}
				}
				if err != nil {
					return err
				}
				sets[f] = set
			}
			c, ok := sets[f][ip]
			if ok && c == uid {
				continue
			}
			if err := s.add(f, ip, uid, ok); err != nil {
				return err
			}
			sets[f][ip] = uid
		}
		return nil
	})
}

// withProbeSets runs fn with the backend's probe store, holding probeMu: the
// probe-set operations list then change, so they must not interleave (a
// removal could otherwise delete an entry an add just relabelled for another
// pod whose IP was reused).
func (m *Manager) withProbeSets(fn func(probeStore) error) error {
	m.probeMu.Lock()
	defer m.probeMu.Unlock()
	s, closeFn, err := m.be.probes()
	if err != nil {
		return err
	}
	defer closeFn()
	return fn(s)
}

// recreateHostRules restores the probe sets and SNAT rules after f's set
// was found gone (someone else removed the host rules).
func (m *Manager) recreateHostRules(ctx context.Context, f Family) error {
	m.log.Warn("probe set missing; recreating it and the host probe rules", "set", f.probeSet(), "backend", string(m.mode))
	return m.be.ensureHost(ctx)
}

// RemoveProbeIPs removes those of ips whose entry comment is uid; an entry
// that now belongs to another pod (its IP was reused) is left alone. A set
// that does not exist holds nothing to remove. Every IP is tried; the errors
// are joined.
func (m *Manager) RemoveProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error {
	return m.withProbeSets(func(s probeStore) error {
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
				set, err := s.list(f)
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
			if err := s.del(f, ip); err != nil && !isNoSet(err) {
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
	return m.withProbeSets(func(s probeStore) error {
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
			have, err := s.list(f)
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
					if err := s.del(f, ip); err != nil {
						return err
					}
				}
			}
			for ip, uid := range want[f] {
				if err := ctx.Err(); err != nil {
					return err
				}
				c, ok := have[ip]
				if ok && c == uid {
					continue
				}
				if err := s.add(f, ip, uid, ok); err != nil {
					return err
				}
			}
		}
		return nil
	})
}
