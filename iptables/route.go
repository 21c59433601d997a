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

func famName(fam int) string {
	if fam == netlink.FAMILY_V6 {
		return "-6 "
	}
	return ""
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

func ensurePolicyRoute(ipv6 bool) error {
	p, err := openPolicy(ipv6)
	if err != nil {
		return err
	}
	defer p.h.Close()
	if p.lo.Attrs().Flags&net.FlagUp == 0 {
		return errors.New("lo is down: the loopback CNI plugin must run before ours")
	}
	return ztunnelPolicy.ensure(p.h, p.lo, p.fams)
}

func verifyPolicyRoute(ipv6 bool) (Drift, error) {
	var d Drift
	p, err := openPolicy(ipv6)
	if err != nil {
		return d, err
	}
	defer p.h.Close()
	err = ztunnelPolicy.missing(p.h, p.lo, p.fams, &d)
	return d, err
}

// deletePolicyRoute removes our rule and route for both families; absent is
// fine.
func deletePolicyRoute() error {
	p, err := openPolicy(false)
	if err != nil {
		return err
	}
	defer p.h.Close()
	return ztunnelPolicy.delete(p.h, p.lo)
}
