// Package sidecar is the node agent's sidecar mode: for a pod Istio's
// injector gave an istio-proxy (and an istio-validation init container
// instead of istio-init), it programs the capture rules Istio's istio-cni
// would program, at CNI ADD, and keeps them (restart verification, the drift
// pass). Which pods are sidecar pods is policy's decision; what
// their rules are is package iptables'. This package reads the pod (Parse),
// remembers the pods it captured (Tracker) and repairs their rules.
package sidecar

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// annotation is one pod annotation Istio's plugin reads: its key, the name
// Istio's errors call it by, its default and its validator.
type annotation struct {
	key, name, def string
	valid          func(string) error
}

// The annotations in the order Istio evaluates them (the first invalid one
// is the error).
var (
	annMode        = annotation{podmeta.AnnotationInterceptionMode, "redirectMode", "REDIRECT", validMode}
	annIncludeIPs  = annotation{podmeta.AnnotationIncludeOutboundIPRanges, "includeIPCidrs", "*", validCIDRsOrWildcard}
	annExcludeIPs  = annotation{podmeta.AnnotationExcludeOutboundIPRanges, "excludeIPCidrs", "", validCIDRs}
	annExcludeIn   = annotation{podmeta.AnnotationExcludeInboundPorts, "excludeInboundPorts", "15020", validPortsOrWildcard}
	annIncludeIn   = annotation{podmeta.AnnotationIncludeInboundPorts, "includeInboundPorts", "*", validPortsOrWildcard}
	annExcludeOut  = annotation{podmeta.AnnotationExcludeOutboundPorts, "excludeOutboundPorts", "15020", validPortsOrWildcard}
	annIncludeOut  = annotation{podmeta.AnnotationIncludeOutboundPorts, "includeOutboundPorts", "", validPortsOrWildcard}
	annExcludeIfs  = annotation{podmeta.AnnotationExcludeInterfaces, "excludeInterfaces", "", validInterfaces}
	annReroute     = annotation{podmeta.AnnotationRerouteVirtualInterfaces, "reroute-virtual-interfaces", "", validInterfaces}
	annKubevirtIfs = annotation{podmeta.AnnotationKubevirtInterfaces, "kubevirtInterfaces", "", validInterfaces}
)

// ErrInvalidAnnotation marks a pod whose sidecar annotations cannot be
// programmed: its CNI ADD fails (as with Istio) until the pod is fixed.
var ErrInvalidAnnotation = errors.New("invalid sidecar annotation")

// value returns the annotation's value (its default when absent), checked.
// The error carries Istio's own text for the same pod, after ours.
func (a annotation) value(ann map[string]string) (string, bool, error) {
	v, ok := ann[a.key]
	if !ok {
		return a.def, false, nil
	}
	if err := a.valid(v); err != nil {
		return "", true, fmt.Errorf("%w %s=%q: annotation value error for value %s; annotationFound = true: %v", ErrInvalidAnnotation, a.key, v, a.name, err)
	}
	return v, true, nil
}

func validMode(v string) error {
	if v != string(iptables.InterceptRedirect) && v != string(iptables.InterceptTProxy) {
		return fmt.Errorf("interceptionMode invalid: %v", v)
	}
	return nil
}

func validCIDRs(v string) error {
	if v == "" {
		return nil
	}
	for _, c := range strings.Split(v, ",") {
		if _, err := netip.ParsePrefix(c); err != nil {
			return fmt.Errorf("failed parsing cidr '%s': %v", c, err)
		}
	}
	return nil
}

func validCIDRsOrWildcard(v string) error {
	if v == "*" {
		return nil
	}
	if err := validCIDRs(v); err != nil {
		return fmt.Errorf("IPRanges invalid: %v", err)
	}
	return nil
}

func parsePort(s string) (uint16, error) {
	p, err := strconv.ParseUint(strings.TrimSpace(s), 10, 16)
	if err != nil {
		return 0, fmt.Errorf("failed parsing port %q: %v", s, err)
	}
	return uint16(p), nil
}

func validPortsOrWildcard(v string) error {
	if v == "*" {
		return nil
	}
	if t := strings.TrimSpace(v); t != "" {
		for _, p := range strings.Split(t, ",") {
			if _, err := parsePort(p); err != nil {
				return fmt.Errorf("portList %q invalid: %v", v, err)
			}
		}
	}
	return nil
}

// validInterfaces checks a comma-separated interface list with the one
// interface-name rule (podopts.ValidInterfaceName, Istio's pattern) and the
// one list rule of the ambient path and the admission policy (items
// trimmed, empty ones skipped — where Istio's sidecar path refuses them: a
// value the policy admits must not fail the pod's ADD for ever), failing
// with Istio's texts.
func validInterfaces(v string) error {
	for _, i := range strings.Split(v, ",") {
		i = strings.TrimSpace(i)
		switch {
		case i == "":
		case len(i) > podopts.MaxInterfaceNameLen:
			return fmt.Errorf("interface name %q too long (max %d chars)", i, podopts.MaxInterfaceNameLen)
		case podopts.ValidInterfaceName(i) != nil:
			return fmt.Errorf("interface name %q contains invalid characters", i)
		}
	}
	return nil
}

// splitList is a comma list as Istio's rule builder splits it: empty items
// dropped, each item trimmed (Istio passes " 9090" on, which the rule tools
// read as 9090).
func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func ports(v string) ([]uint16, error) {
	var out []uint16
	for _, s := range splitList(v) {
		p, err := parsePort(s)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// Parsed is what Parse read of a pod.
type Parsed struct {
	Options iptables.SidecarOptions
	// Warnings are values Istio ignores with a warning (an unparseable
	// boolean in istio-proxy's env counts as false).
	Warnings []string
}

// Parse reads a sidecar pod's capture options as Istio's istio-cni does:
// the annotations (defaults and validation), istio-proxy's uid/gid and env,
// and the pod's addresses (ips, in the order the pod's interfaces hold
// them; the first usable one decides the family unless ISTIO_DUAL_STACK).
// An invalid annotation is an error wrapping ErrInvalidAnnotation whose text
// ends with Istio's own error for the same pod.
func Parse(pod *corev1.Pod, ips []netip.Addr) (Parsed, error) {
	var p Parsed
	o := &p.Options
	ann := pod.Annotations
	mode, _, err := annMode.value(ann)
	if err != nil {
		return p, err
	}
	o.Mode = iptables.InterceptMode(mode)
	proxy := policy.ProxyInfo(pod)
	o.ProxyUID, o.ProxyGID = iptables.DefaultProxyID, iptables.DefaultProxyID
	if proxy.UID != nil && *proxy.UID > 0 {
		o.ProxyUID = uint32(*proxy.UID)
	}
	if proxy.GID != nil && *proxy.GID > 0 {
		o.ProxyGID = uint32(*proxy.GID)
	}
	a, err := readCapture(ann)
	if err != nil {
		return p, err
	}
	if err := a.apply(o, ann); err != nil {
		return p, err
	}

	flag := func(name string) bool {
		v, ok := proxy.Env[name]
		if !ok {
			return false
		}
		b, err := strconv.ParseBool(v)
		if err != nil {
			p.Warnings = append(p.Warnings, fmt.Sprintf("istio-proxy env %s=%q is not a boolean: taken as false (as Istio does)", name, v))
		}
		return b
	}
	o.DNS = flag("ISTIO_META_DNS_CAPTURE")
	dualStack := flag("ISTIO_DUAL_STACK")
	o.InvalidDrop = flag("INVALID_DROP")

	v6, err := ipv6(ips, dualStack)
	if err != nil {
		return p, err
	}
	o.IPv6 = v6
	return p, o.Validate()
}

// capture is the text of a pod's capture annotations, defaults applied.
type capture struct {
	include, exclude       string // outbound CIDRs
	includeIn, excludeIn   string // inbound ports
	includeOut, excludeOut string // outbound ports
	excludeIfs, reroute    string // interfaces
}

// readCapture reads the capture annotations in Istio's order, so the same
// invalid one is reported first.
func readCapture(ann map[string]string) (capture, error) {
	var c capture
	for _, v := range []struct {
		a   annotation
		dst *string
	}{
		{annIncludeIPs, &c.include}, {annExcludeIPs, &c.exclude}, {annExcludeIn, &c.excludeIn}, {annIncludeIn, &c.includeIn},
		{annExcludeOut, &c.excludeOut}, {annIncludeOut, &c.includeOut}, {annExcludeIfs, &c.excludeIfs},
	} {
		var err error
		if *v.dst, _, err = v.a.value(ann); err != nil {
			return c, err
		}
	}
	reroute, found, err := annReroute.value(ann)
	if err != nil {
		return c, err
	}
	if !found {
		if reroute, _, err = annKubevirtIfs.value(ann); err != nil {
			return c, err
		}
	}
	c.reroute = reroute
	return c, nil
}

// apply parses c's lists into o; ann is the pod's annotations, quoted in
// errors.
func (c capture) apply(o *iptables.SidecarOptions, ann map[string]string) error {
	var err error
	if c.include == "*" {
		o.IncludeAllOutbound = true
	} else if o.IncludeOutboundCIDRs, err = cidrs(c.include); err != nil {
		return err
	}
	if o.ExcludeOutboundCIDRs, err = cidrs(c.exclude); err != nil {
		return err
	}
	if c.includeIn == "*" {
		o.IncludeAllInbound = true
	} else if o.IncludeInboundPorts, err = ports(c.includeIn); err != nil {
		return err
	}
	if o.ExcludeInboundPorts, err = ports(withIstioPorts(c.excludeIn)); err != nil {
		return fmt.Errorf("%w %s=%q: %v", ErrInvalidAnnotation, annExcludeIn.key, ann[annExcludeIn.key], err)
	}
	for _, l := range []struct {
		v   string
		a   annotation
		dst *[]uint16
	}{{c.includeOut, annIncludeOut, &o.IncludeOutboundPorts}, {c.excludeOut, annExcludeOut, &o.ExcludeOutboundPorts}} {
		if *l.dst, err = ports(l.v); err != nil {
			// "*" passes Istio's check and then fails at the rule tools.
			return fmt.Errorf("%w %s=%q: %v", ErrInvalidAnnotation, l.a.key, l.v, err)
		}
	}
	o.ExcludeInterfaces, o.RerouteInterfaces = splitList(c.excludeIfs), splitList(c.reroute)
	return nil
}

// withIstioPorts is the excluded inbound ports plus Istio's status, health
// and metrics ports, which Istio always excludes, after the pod's own,
// each once (a repeat spelled differently stays).
func withIstioPorts(excludeIn string) string {
	excludeIn = strings.TrimSpace(excludeIn)
	if excludeIn != "" && !strings.HasSuffix(excludeIn, ",") {
		excludeIn += ","
	}
	excludeIn += "15020,15021,15090"
	var seen []string
	for _, s := range strings.Split(excludeIn, ",") {
		if !slices.Contains(seen, s) {
			seen = append(seen, s)
		}
	}
	return strings.Join(seen, ",")
}

func cidrs(v string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range splitList(v) {
		c, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%w: CIDR %q: %v", ErrInvalidAnnotation, s, err)
		}
		out = append(out, c)
	}
	return out, nil
}

// ErrNoAddress: the pod has no address its rules could be for.
var ErrNoAddress = errors.New("no valid local IP address found")

// ipv6 decides whether the pod's IPv6 traffic is captured, as Istio does
// from the pod's interface addresses: with ISTIO_DUAL_STACK when it has an
// IPv6 address, else when its first usable address is IPv6. The kernel
// lists a pod's IPv4 addresses before its IPv6 ones, so a dual-stack pod
// without the flag is IPv4 only (Istio's behaviour: its IPv6 stays
// uncaptured; docs/sidecar.md).
func ipv6(ips []netip.Addr, dualStack bool) (bool, error) {
	var has4, has6 bool
	for _, ip := range ips {
		ip = ip.Unmap()
		if !ip.IsValid() || ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() {
			continue
		}
		if ip.Is4() {
			has4 = true
		} else {
			has6 = true
		}
	}
	switch {
	case !has4 && !has6:
		return false, ErrNoAddress
	case dualStack:
		return has6, nil
	}
	return !has4, nil
}
