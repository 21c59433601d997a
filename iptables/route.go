package iptables

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The policy route inside the pod: packets carrying the connmark-restored
// 0x111 mark (replies to connections ztunnel made with a spoofed source) look
// up table 100, whose only route delivers everything locally via lo.
//
// These functions act on the calling thread's network namespace; callers run
// them inside inNS.

func policyFamilies(h *netlink.Handle, lo netlink.Link, ipv6 bool) ([]int, error) {
	fams := []int{netlink.FAMILY_V4}
	if !ipv6 {
		return fams, nil
	}
	// IPv6 only when lo has an IPv6 address: a pod with IPv6 disabled has
	// none, and the route would be refused.
	addrs, err := h.AddrList(lo, netlink.FAMILY_V6)
	if err != nil {
		return nil, fmt.Errorf("listing IPv6 addresses of lo: %w", err)
	}
	if len(addrs) > 0 {
		fams = append(fams, netlink.FAMILY_V6)
	}
	return fams, nil
}

func ourRule(fam int) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = fam
	r.Priority = RulePriority
	r.Mark = ConnMark
	mask := uint32(MarkMask)
	r.Mask = &mask
	r.Table = RouteTable
	return r
}

func isOurRule(r netlink.Rule) bool {
	return r.Table == RouteTable && r.Mark == ConnMark && r.Mask != nil && *r.Mask == MarkMask && !r.Invert
}

func ourRoute(fam int, lo netlink.Link) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if fam == netlink.FAMILY_V6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{
		Family:    fam,
		LinkIndex: lo.Attrs().Index,
		Dst:       dst,
		Table:     RouteTable,
		Type:      unix.RTN_LOCAL,
		Scope:     netlink.SCOPE_HOST,
	}
}

func isOurRoute(r netlink.Route, lo netlink.Link) bool {
	ones := 0
	if r.Dst != nil {
		ones, _ = r.Dst.Mask.Size()
	}
	return r.Table == RouteTable && r.Type == unix.RTN_LOCAL && r.LinkIndex == lo.Attrs().Index && ones == 0
}

func famName(fam int) string {
	if fam == netlink.FAMILY_V6 {
		return "-6 "
	}
	return ""
}

func ruleText(fam int) string {
	return fmt.Sprintf("ip %srule pref %d fwmark %#x/%#x lookup %d", famName(fam), RulePriority, ConnMark, MarkMask, RouteTable)
}

func routeText(fam int) string {
	dst := "0.0.0.0/0"
	if fam == netlink.FAMILY_V6 {
		dst = "::/0"
	}
	return fmt.Sprintf("ip %sroute local %s dev lo table %d", famName(fam), dst, RouteTable)
}

type policyState struct {
	h    *netlink.Handle
	lo   netlink.Link
	fams []int
}

func openPolicy(ipv6 bool) (*policyState, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	lo, err := h.LinkByName("lo")
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("finding lo: %w", err)
	}
	fams, err := policyFamilies(h, lo, ipv6)
	if err != nil {
		h.Close()
		return nil, err
	}
	return &policyState{h: h, lo: lo, fams: fams}, nil
}

func (p *policyState) hasRule(fam int) (bool, error) {
	rules, err := p.h.RuleList(fam)
	if err != nil {
		return false, fmt.Errorf("listing ip rules: %w", err)
	}
	for _, r := range rules {
		if isOurRule(r) {
			return true, nil
		}
	}
	return false, nil
}

func (p *policyState) hasRoute(fam int) (bool, error) {
	routes, err := p.h.RouteListFiltered(fam, &netlink.Route{Table: RouteTable}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return false, fmt.Errorf("listing routes of table %d: %w", RouteTable, err)
	}
	for _, r := range routes {
		if isOurRoute(r, p.lo) {
			return true, nil
		}
	}
	return false, nil
}

func ensurePolicyRoute(ipv6 bool) error {
	p, err := openPolicy(ipv6)
	if err != nil {
		return err
	}
	defer p.h.Close()
	if p.lo.Attrs().Flags&net.FlagUp == 0 {
		return errors.New("lo is down: the loopback CNI plugin must run before ours")
	}
	for _, fam := range p.fams {
		ok, err := p.hasRule(fam)
		if err != nil {
			return err
		}
		if !ok {
			if err := p.h.RuleAdd(ourRule(fam)); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("%s: %w", ruleText(fam), err)
			}
		}
		if err := p.h.RouteReplace(ourRoute(fam, p.lo)); err != nil {
			return fmt.Errorf("%s: %w", routeText(fam), err)
		}
	}
	return nil
}

func verifyPolicyRoute(ipv6 bool) (Drift, error) {
	var d Drift
	p, err := openPolicy(ipv6)
	if err != nil {
		return d, err
	}
	defer p.h.Close()
	for _, fam := range p.fams {
		ok, err := p.hasRule(fam)
		if err != nil {
			return d, err
		}
		if !ok {
			d.Missing = append(d.Missing, ruleText(fam))
		}
		if ok, err = p.hasRoute(fam); err != nil {
			return d, err
		} else if !ok {
			d.Missing = append(d.Missing, routeText(fam))
		}
	}
	return d, nil
}

// deletePolicyRoute removes our rule and route for both families; absent is
// fine.
func deletePolicyRoute() error {
	p, err := openPolicy(false)
	if err != nil {
		return err
	}
	defer p.h.Close()
	var errs []error
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rules, err := p.h.RuleList(fam)
		if err != nil {
			errs = append(errs, fmt.Errorf("listing ip rules: %w", err))
			continue
		}
		for _, r := range rules {
			if isOurRule(r) {
				if err := p.h.RuleDel(&r); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("deleting %s: %w", ruleText(fam), err))
				}
			}
		}
		routes, err := p.h.RouteListFiltered(fam, &netlink.Route{Table: RouteTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			errs = append(errs, fmt.Errorf("listing routes of table %d: %w", RouteTable, err))
			continue
		}
		for _, r := range routes {
			if isOurRoute(r, p.lo) {
				if err := p.h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("deleting %s: %w", routeText(fam), err))
				}
			}
		}
	}
	return errors.Join(errs...)
}
