package rules

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Node is what a rule set depends on besides the pod's options: the node's
// settings every backend renders from.
type Node struct {
	// IPv6 adds the IPv6 rules (and the IPv6 policy route and probe set).
	IPv6 bool
	// RerouteInterfaces are virtual interfaces (e.g. a VM's tap) whose TCP
	// entering the pod is sent to ztunnel's outbound port.
	RerouteInterfaces []string
}

// Families returns the address families the node programs.
func (n Node) Families() []Family { return Families(n.IPv6) }

// PodOptions are the per-pod choices (the agent derives them from the pod's
// annotations and its DNS capture default).
type PodOptions struct {
	// BypassInbound drops the inbound redirect (and the probe accept that
	// only matters for it).
	BypassInbound bool
	// DNSCapture redirects the pod's DNS to ztunnel's 15053.
	DNSCapture bool
	// RerouteInterfaces is a comma-separated list of the pod's virtual
	// interfaces (e.g. a KubeVirt VM's tap0) whose TCP is sent to ztunnel's
	// outbound port, in addition to the node's. A string, not a slice, so
	// PodOptions stays comparable (the rule cache's key).
	RerouteInterfaces string
}

// Validate checks the options, naming what is wrong.
func (o PodOptions) Validate() error {
	if o.RerouteInterfaces == "" {
		return nil
	}
	for _, i := range strings.Split(o.RerouteInterfaces, ",") {
		if err := ValidInterfaceName(i); err != nil {
			return err
		}
	}
	return nil
}

// MaxInterfaceNameLen is the longest Linux interface name (IFNAMSIZ - 1).
const MaxInterfaceNameLen = 15

// interfaceName is the pattern Istio validates interface names with, in its
// sidecar path and its injector (istio/istio#58785): a letter, then letters,
// digits, "_", "." and "-" — nothing a backend could read as more than one
// exact interface (iptables' "+" wildcard, nftables' "*", spaces that
// smuggle options, a leading "-" or ".").
var interfaceName = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9_.-]*$`)

// ValidInterfaceName reports whether name is one exact interface name, so
// that every backend matches exactly that interface. It is the one rule for
// the node's --reroute-interface, the pods' interface annotations in the
// ambient path and in sidecar mode, and the pod-annotation admission policy
// (deploy/pod-admission.yaml; admission/cases/annotations.json holds both).
func ValidInterfaceName(name string) error {
	if name == "" || len(name) > MaxInterfaceNameLen || !interfaceName.MatchString(name) {
		return fmt.Errorf("%q is not an interface name (1-%d of a-z A-Z 0-9 _ . -, starting with a letter)", name, MaxInterfaceNameLen)
	}
	return nil
}

// RerouteInterfaces is the node's reroute interfaces followed by the pod's
// own, each once.
func RerouteInterfaces(n Node, opts PodOptions) []string {
	out := slices.Clone(n.RerouteInterfaces)
	if opts.RerouteInterfaces != "" {
		for _, i := range strings.Split(opts.RerouteInterfaces, ",") {
			if !slices.Contains(out, i) {
				out = append(out, i)
			}
		}
	}
	return out
}
