package iptables

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The sidecar rules' netlink state inside the pod, as Istio sets it up:
// with IPv6 captured, ::6 on lo (Envoy's inbound passthrough binds it);
// under TPROXY with inbound capture, a policy route per family — packets
// marked 1337 look up table 133, whose only route delivers everything
// locally — so TPROXY'd connections reach Envoy's transparent listener.
// These act on the calling thread's namespace (callers run them in inNS).

func sidecarFams(o SidecarOptions) []int {
	fams := []int{netlink.FAMILY_V4}
	if o.IPv6 {
		fams = append(fams, netlink.FAMILY_V6)
	}
	return fams
}

func tproxyRoutes(o SidecarOptions) bool { return o.TProxy() && o.InboundCaptured() }

func isTProxyRule(r netlink.Rule) bool {
	return r.Table == SidecarTProxyTable && r.Mark == SidecarTProxyMark && !r.Invert &&
		(r.Mask == nil || *r.Mask == 0xffffffff)
}

func tproxyRuleText(fam int) string {
	return fmt.Sprintf("ip %srule fwmark %#x/0xffffffff lookup %d", famName(fam), SidecarTProxyMark, SidecarTProxyTable)
}

func tproxyRouteText(fam int) string {
	dst := "0.0.0.0/0"
	if fam == netlink.FAMILY_V6 {
		dst = "::/0"
	}
	return fmt.Sprintf("ip %sroute local %s dev lo table %d", famName(fam), dst, SidecarTProxyTable)
}

const passthroughV6Text = "ip -6 addr add ::6/128 dev lo"

func passthroughV6() *netlink.Addr {
	return &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("::6"), Mask: net.CIDRMask(128, 128)}}
}

type sidecarNet struct {
	h  *netlink.Handle
	lo netlink.Link
}

func openSidecarNet() (*sidecarNet, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	lo, err := h.LinkByName("lo")
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("finding lo: %w", err)
	}
	return &sidecarNet{h: h, lo: lo}, nil
}

func (s *sidecarNet) hasPassthrough() (bool, error) {
	addrs, err := s.h.AddrList(s.lo, netlink.FAMILY_V6)
	if err != nil {
		return false, fmt.Errorf("listing IPv6 addresses of lo: %w", err)
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && ip == netip.MustParseAddr("::6") {
			return true, nil
		}
	}
	return false, nil
}

func (s *sidecarNet) hasTProxyRule(fam int) (bool, error) {
	rs, err := s.h.RuleList(fam)
	if err != nil {
		return false, fmt.Errorf("listing ip rules: %w", err)
	}
	for _, r := range rs {
		if isTProxyRule(r) {
			return true, nil
		}
	}
	return false, nil
}

func (s *sidecarNet) tproxyRoutes(fam int) ([]netlink.Route, error) {
	rs, err := s.h.RouteListFiltered(fam, &netlink.Route{Table: SidecarTProxyTable}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("listing routes of table %d: %w", SidecarTProxyTable, err)
	}
	var out []netlink.Route
	for _, r := range rs {
		ones := 0
		if r.Dst != nil {
			ones, _ = r.Dst.Mask.Size()
		}
		if r.Type == unix.RTN_LOCAL && r.LinkIndex == s.lo.Attrs().Index && ones == 0 {
			out = append(out, r)
		}
	}
	return out, nil
}

func tproxyRule(fam int) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = fam
	r.Mark = SidecarTProxyMark
	mask := uint32(0xffffffff)
	r.Mask = &mask
	r.Table = SidecarTProxyTable
	return r
}

func tproxyRoute(fam int, lo netlink.Link) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	scope := netlink.SCOPE_HOST
	if fam == netlink.FAMILY_V6 {
		dst, scope = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}, netlink.SCOPE_UNIVERSE
	}
	return &netlink.Route{Family: fam, LinkIndex: lo.Attrs().Index, Dst: dst, Table: SidecarTProxyTable, Type: unix.RTN_LOCAL, Scope: scope}
}

// ensureSidecarNet adds what o needs and is missing.
func ensureSidecarNet(o SidecarOptions) error {
	s, err := openSidecarNet()
	if err != nil {
		return err
	}
	defer s.h.Close()
	if o.IPv6 {
		if ok, err := s.hasPassthrough(); err != nil {
			return err
		} else if !ok {
			if err := s.h.AddrAdd(s.lo, passthroughV6()); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("%s: %w", passthroughV6Text, err)
			}
		}
	}
	if !tproxyRoutes(o) {
		return nil
	}
	for _, fam := range sidecarFams(o) {
		ok, err := s.hasTProxyRule(fam)
		if err != nil {
			return err
		}
		if !ok {
			if err := s.h.RuleAdd(tproxyRule(fam)); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("%s: %w", tproxyRuleText(fam), err)
			}
		}
		if err := s.h.RouteReplace(tproxyRoute(fam, s.lo)); err != nil {
			return fmt.Errorf("%s: %w", tproxyRouteText(fam), err)
		}
	}
	return nil
}

// verifySidecarNet reports what o needs and is missing.
func verifySidecarNet(o SidecarOptions) (Drift, error) {
	var d Drift
	s, err := openSidecarNet()
	if err != nil {
		return d, err
	}
	defer s.h.Close()
	if o.IPv6 {
		if ok, err := s.hasPassthrough(); err != nil {
			return d, err
		} else if !ok {
			d.Missing = append(d.Missing, passthroughV6Text)
		}
	}
	if !tproxyRoutes(o) {
		return d, nil
	}
	for _, fam := range sidecarFams(o) {
		if ok, err := s.hasTProxyRule(fam); err != nil {
			return d, err
		} else if !ok {
			d.Missing = append(d.Missing, tproxyRuleText(fam))
		}
		if rs, err := s.tproxyRoutes(fam); err != nil {
			return d, err
		} else if len(rs) == 0 {
			d.Missing = append(d.Missing, tproxyRouteText(fam))
		}
	}
	return d, nil
}

// deleteSidecarNet removes the TPROXY policy route of both families
// (absent is fine). ::6 stays on lo: harmless, and Istio never removes it.
func deleteSidecarNet() error {
	s, err := openSidecarNet()
	if err != nil {
		return err
	}
	defer s.h.Close()
	var errs []error
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := s.h.RuleList(fam)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, r := range rs {
			if isTProxyRule(r) {
				if err := s.h.RuleDel(&r); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("deleting %s: %w", tproxyRuleText(fam), err))
				}
			}
		}
		routes, err := s.tproxyRoutes(fam)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, r := range routes {
			if err := s.h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("deleting %s: %w", tproxyRouteText(fam), err))
			}
		}
	}
	return errors.Join(errs...)
}
