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
// under TPROXY with inbound capture, a policy route per family
// (tproxyPolicy: packets marked 1337 look up table 133, whose only route
// delivers everything locally) so TPROXY'd connections reach Envoy's
// transparent listener.
// These act on the calling thread's namespace (callers run them in inNS).

func sidecarFams(o SidecarOptions) []int {
	fams := []int{netlink.FAMILY_V4}
	if o.IPv6 {
		fams = append(fams, netlink.FAMILY_V6)
	}
	return fams
}

func tproxyRoutes(o SidecarOptions) bool { return o.TProxy() && o.InboundCaptured() }

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
	return tproxyPolicy.ensure(s.h, s.lo, sidecarFams(o))
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
	err = tproxyPolicy.missing(s.h, s.lo, sidecarFams(o), &d)
	return d, err
}

// deleteSidecarNet removes the TPROXY policy route of both families
// (absent is fine). ::6 stays on lo: harmless, and Istio never removes it.
func deleteSidecarNet() error {
	s, err := openSidecarNet()
	if err != nil {
		return err
	}
	defer s.h.Close()
	return tproxyPolicy.delete(s.h, s.lo)
}
