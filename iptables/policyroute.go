package iptables

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// policyRoute is a mark-based policy route inside a pod: packets whose mark
// (under mask) matches look up table, whose only route delivers everything
// locally via lo. Two exist, both Istio's: ztunnel's (ztunnelPolicy: replies
// to connections ztunnel made with a spoofed source) and, for sidecar pods
// under TPROXY, Envoy's (tproxyPolicy). The methods act on the namespace of
// the handle they are given.
type policyRoute struct {
	priority   int // 0: the kernel's choice
	mark, mask uint32
	table      int
	v6Scope    netlink.Scope // the IPv6 route's scope (IPv4's is host)
}

var (
	ztunnelPolicy = policyRoute{priority: RulePriority, mark: ConnMark, mask: MarkMask, table: RouteTable, v6Scope: netlink.SCOPE_HOST}
	tproxyPolicy  = policyRoute{mark: SidecarTProxyMark, mask: 0xffffffff, table: SidecarTProxyTable, v6Scope: netlink.SCOPE_UNIVERSE}
)

func (p policyRoute) rule(fam int) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = fam
	if p.priority > 0 {
		r.Priority = p.priority
	}
	r.Mark = p.mark
	mask := p.mask
	r.Mask = &mask
	r.Table = p.table
	return r
}

// isRule: a rule without a mask matches the whole mark.
func (p policyRoute) isRule(r netlink.Rule) bool {
	mask := uint32(0xffffffff)
	if r.Mask != nil {
		mask = *r.Mask
	}
	return r.Table == p.table && r.Mark == p.mark && mask == p.mask && !r.Invert
}

func (p policyRoute) route(fam int, lo netlink.Link) *netlink.Route {
	dst, scope := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}, netlink.SCOPE_HOST
	if fam == netlink.FAMILY_V6 {
		dst, scope = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}, p.v6Scope
	}
	return &netlink.Route{Family: fam, LinkIndex: lo.Attrs().Index, Dst: dst, Table: p.table, Type: unix.RTN_LOCAL, Scope: scope}
}

func (p policyRoute) ruleText(fam int) string {
	pref := ""
	if p.priority > 0 {
		pref = fmt.Sprintf("pref %d ", p.priority)
	}
	return fmt.Sprintf("ip %srule %sfwmark %#x/%#x lookup %d", famName(fam), pref, p.mark, p.mask, p.table)
}

func (p policyRoute) routeText(fam int) string {
	dst := "0.0.0.0/0"
	if fam == netlink.FAMILY_V6 {
		dst = "::/0"
	}
	return fmt.Sprintf("ip %sroute local %s dev lo table %d", famName(fam), dst, p.table)
}

func (p policyRoute) hasRule(h *netlink.Handle, fam int) (bool, error) {
	rs, err := h.RuleList(fam)
	if err != nil {
		return false, fmt.Errorf("listing ip rules: %w", err)
	}
	for _, r := range rs {
		if p.isRule(r) {
			return true, nil
		}
	}
	return false, nil
}

// routes returns the table's routes that are ours (local, everything, via lo).
func (p policyRoute) routes(h *netlink.Handle, lo netlink.Link, fam int) ([]netlink.Route, error) {
	rs, err := h.RouteListFiltered(fam, &netlink.Route{Table: p.table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("listing routes of table %d: %w", p.table, err)
	}
	var out []netlink.Route
	for _, r := range rs {
		ones := 0
		if r.Dst != nil {
			ones, _ = r.Dst.Mask.Size()
		}
		if r.Type == unix.RTN_LOCAL && r.LinkIndex == lo.Attrs().Index && ones == 0 {
			out = append(out, r)
		}
	}
	return out, nil
}

// ensure adds the rule where missing and (re)writes the route, per family.
func (p policyRoute) ensure(h *netlink.Handle, lo netlink.Link, fams []int) error {
	for _, fam := range fams {
		ok, err := p.hasRule(h, fam)
		if err != nil {
			return err
		}
		if !ok {
			if err := h.RuleAdd(p.rule(fam)); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("%s: %w", p.ruleText(fam), err)
			}
		}
		if err := h.RouteReplace(p.route(fam, lo)); err != nil {
			return fmt.Errorf("%s: %w", p.routeText(fam), err)
		}
	}
	return nil
}

// missing adds to d what fams lack of the rule and the route.
func (p policyRoute) missing(h *netlink.Handle, lo netlink.Link, fams []int, d *Drift) error {
	for _, fam := range fams {
		if ok, err := p.hasRule(h, fam); err != nil {
			return err
		} else if !ok {
			d.Missing = append(d.Missing, p.ruleText(fam))
		}
		if rs, err := p.routes(h, lo, fam); err != nil {
			return err
		} else if len(rs) == 0 {
			d.Missing = append(d.Missing, p.routeText(fam))
		}
	}
	return nil
}

// delete removes the rule and the route of both families; absent is fine.
func (p policyRoute) delete(h *netlink.Handle, lo netlink.Link) error {
	var errs []error
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := h.RuleList(fam)
		if err != nil {
			errs = append(errs, fmt.Errorf("listing ip rules: %w", err))
			continue
		}
		for _, r := range rs {
			if p.isRule(r) {
				if err := h.RuleDel(&r); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("deleting %s: %w", p.ruleText(fam), err))
				}
			}
		}
		routes, err := p.routes(h, lo, fam)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, r := range routes {
			if err := h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("deleting %s: %w", p.routeText(fam), err))
			}
		}
	}
	return errors.Join(errs...)
}
