package rules

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Sidecar mode: the rules Istio's node agent (istio-cni) programs in a pod
// that Istio's injector gave an istio-proxy sidecar (and an istio-validation
// init container instead of the privileged istio-init). The traffic goes to
// the pod's own Envoy, not to ztunnel: outbound to 15001, inbound to 15006,
// DNS to the agent's 15053. Values are Istio's (docs/sidecar.md).
const (
	// SidecarOutboundPort is Envoy's outbound capture port.
	SidecarOutboundPort = 15001
	// SidecarInboundPort is Envoy's inbound capture port.
	SidecarInboundPort = 15006
	// SidecarTunnelPort (HBONE) is never captured inbound.
	SidecarTunnelPort = 15008
	// SidecarDNSPort is the Istio agent's DNS proxy.
	SidecarDNSPort = 15053
	// SidecarProbePort is where istio-validation dials 127.0.0.6 (::6) to
	// prove the redirection: the rules send it to 15006, where it reads
	// the original destination back.
	SidecarProbePort = 15002
	// SidecarTProxyMark marks TPROXY'd inbound packets (and is the fwmark
	// of the TPROXY policy route); SidecarOutboundMark marks the proxy's
	// own connections to the pod's address under TPROXY.
	SidecarTProxyMark   = 1337
	SidecarOutboundMark = 1338
	// SidecarTProxyTable is the routing table of the TPROXY policy route.
	SidecarTProxyTable = 133
	// DefaultProxyID is the proxy's uid and gid unless its securityContext
	// says otherwise.
	DefaultProxyID = 1337
)

// SidecarInboundPassthrough is the source address Envoy's inbound
// passthrough cluster binds (127.0.0.6, ::6): never captured again.
func SidecarInboundPassthrough(f Family) netip.Addr {
	if f == IPv6 {
		return netip.MustParseAddr("::6")
	}
	return netip.MustParseAddr("127.0.0.6")
}

// SidecarAlwaysExcludedInboundPorts are appended to every pod's inbound
// exclusions, as Istio does: the agent's status port, Envoy's health port
// and its Prometheus port.
var SidecarAlwaysExcludedInboundPorts = []uint16{15020, 15021, 15090}

// InterceptMode is how inbound traffic reaches the proxy.
type InterceptMode string

const (
	// InterceptRedirect is NAT REDIRECT (the default): the app sees
	// connections from 127.0.0.6.
	InterceptRedirect InterceptMode = "REDIRECT"
	// InterceptTProxy keeps the client's address (mangle TPROXY, mark
	// 1337, policy route table 133).
	InterceptTProxy InterceptMode = "TPROXY"
)

// SidecarOptions is everything the sidecar rules of one pod depend on:
// parsed and validated from the pod (annotations, the istio-proxy
// container's uid/gid and env, its addresses) by the agent, never by the
// rule code. Lists keep the order the pod gives them (the rules do too).
type SidecarOptions struct {
	Mode InterceptMode
	// ProxyUID and ProxyGID own the proxy's sockets: their traffic is not
	// captured again.
	ProxyUID, ProxyGID uint32

	// IncludeAllOutbound captures all outbound TCP ("*"); otherwise only
	// to IncludeOutboundCIDRs (none: no outbound capture by address).
	IncludeAllOutbound   bool
	IncludeOutboundCIDRs []netip.Prefix
	ExcludeOutboundCIDRs []netip.Prefix
	// IncludeAllInbound captures all inbound TCP ("*") but
	// ExcludeInboundPorts; otherwise only IncludeInboundPorts (none: no
	// inbound capture at all).
	IncludeAllInbound   bool
	IncludeInboundPorts []uint16
	ExcludeInboundPorts []uint16
	// IncludeOutboundPorts are captured whatever their address;
	// ExcludeOutboundPorts never (TCP and UDP).
	IncludeOutboundPorts []uint16
	ExcludeOutboundPorts []uint16

	// RerouteInterfaces (KubeVirt): TCP entering on them is the pod's
	// outbound traffic. ExcludeInterfaces: traffic on them is never
	// captured.
	RerouteInterfaces []string
	ExcludeInterfaces []string

	// DNS redirects all port-53 traffic (TCP and UDP) to 15053, with the
	// conntrack zones that keep the proxy's upstream queries apart.
	DNS bool
	// IPv6 adds the IPv6 rules (the pod's address family decides, as in
	// Istio).
	IPv6 bool
	// InvalidDrop drops packets conntrack calls INVALID.
	InvalidDrop bool
}

// TProxy reports whether inbound capture uses TPROXY.
func (o SidecarOptions) TProxy() bool { return o.Mode == InterceptTProxy }

// Families returns IPv4, and IPv6 when the pod's rules cover it.
func (o SidecarOptions) Families() []Family { return Families(o.IPv6) }

// InboundCaptured reports whether any inbound traffic is captured (the
// TPROXY policy route exists only then).
func (o SidecarOptions) InboundCaptured() bool {
	return o.IncludeAllInbound || len(o.IncludeInboundPorts) > 0
}

// OutboundCIDRs returns the include or exclude CIDRs of one family.
func OutboundCIDRs(cidrs []netip.Prefix, f Family) []netip.Prefix {
	var out []netip.Prefix
	for _, c := range cidrs {
		if c.Addr().Is6() == (f == IPv6) {
			out = append(out, c)
		}
	}
	return out
}

// IncludesLoopback reports whether an include CIDR is a loopback range:
// then the proxy's "other loopback traffic returns" rules are left out, so
// an app's loopback traffic to that range is captured.
func (o SidecarOptions) IncludesLoopback() bool {
	return slices.ContainsFunc(o.IncludeOutboundCIDRs, func(p netip.Prefix) bool { return p.Addr().IsLoopback() })
}

// Validate checks what the rule text depends on: known mode, interface
// names that cannot smuggle another match into a rule, masked prefixes.
func (o SidecarOptions) Validate() error {
	if o.Mode != InterceptRedirect && o.Mode != InterceptTProxy {
		return fmt.Errorf("sidecar interception mode %q: want REDIRECT or TPROXY", o.Mode)
	}
	for _, names := range [][]string{o.RerouteInterfaces, o.ExcludeInterfaces} {
		for _, n := range names {
			if err := ValidInterfaceName(n); err != nil {
				return err
			}
		}
	}
	for _, cidrs := range [][]netip.Prefix{o.IncludeOutboundCIDRs, o.ExcludeOutboundCIDRs} {
		for _, c := range cidrs {
			if !c.IsValid() {
				return fmt.Errorf("invalid CIDR %v", c)
			}
		}
	}
	return nil
}

// Key is a stable text of the options, for caches and logs.
func (o SidecarOptions) Key() string {
	var b strings.Builder
	fmt.Fprintf(&b, "mode=%s uid=%d gid=%d dns=%t ipv6=%t drop=%t", o.Mode, o.ProxyUID, o.ProxyGID, o.DNS, o.IPv6, o.InvalidDrop)
	cidrs := func(name string, all bool, l []netip.Prefix) {
		b.WriteString(" " + name + "=")
		if all {
			b.WriteString("*")
		}
		for i, c := range l {
			if i > 0 || all {
				b.WriteString(",")
			}
			b.WriteString(c.String())
		}
	}
	ports := func(name string, all bool, l []uint16) {
		b.WriteString(" " + name + "=")
		if all {
			b.WriteString("*")
		}
		for i, p := range l {
			if i > 0 || all {
				b.WriteString(",")
			}
			b.WriteString(strconv.Itoa(int(p)))
		}
	}
	cidrs("out+", o.IncludeAllOutbound, o.IncludeOutboundCIDRs)
	cidrs("out-", false, o.ExcludeOutboundCIDRs)
	ports("in+", o.IncludeAllInbound, o.IncludeInboundPorts)
	ports("in-", false, o.ExcludeInboundPorts)
	ports("outport+", false, o.IncludeOutboundPorts)
	ports("outport-", false, o.ExcludeOutboundPorts)
	b.WriteString(" reroute=" + strings.Join(o.RerouteInterfaces, ","))
	b.WriteString(" exclude-if=" + strings.Join(o.ExcludeInterfaces, ","))
	return b.String()
}
