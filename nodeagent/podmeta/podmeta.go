// Package podmeta is the one home of the Istio label and annotation names and
// values the agent reads and writes, and of the parsing of a pod's capture
// options from its annotations. The rules package gets plain PodOptions.
package podmeta

import (
	"fmt"
	"slices"
	"strings"

	"github.com/ambientd/ambientd/iptables"
)

// Labels and annotations shared with Istio, so pods and namespaces labelled
// for istio-cni behave the same under ambientd.
const (
	// LabelDataplaneMode on a pod or namespace enrolls (ModeAmbient) or
	// opts out (ModeNone).
	LabelDataplaneMode = "istio.io/dataplane-mode"
	ModeAmbient        = "ambient"
	ModeNone           = "none"
	// AnnotationSidecarStatus marks a pod with an injected sidecar.
	AnnotationSidecarStatus = "sidecar.istio.io/status"
	// AnnotationRedirection is what the agent writes: RedirectionEnabled
	// or RedirectionPending, removed when the pod leaves the mesh.
	AnnotationRedirection = "ambient.istio.io/redirection"
	RedirectionEnabled    = "enabled"
	RedirectionPending    = "pending"
	// AnnotationBypassInbound drops inbound capture when "true".
	AnnotationBypassInbound = "ambient.istio.io/bypass-inbound-capture"
	// AnnotationDNSCapture overrides the node's DNS capture default.
	AnnotationDNSCapture = "ambient.istio.io/dns-capture"
	// AnnotationRerouteVirtualInterfaces lists (comma separated) the pod's
	// virtual interfaces, e.g. a KubeVirt VM's tap0, whose incoming TCP is
	// sent to ztunnel's outbound port (the VM's traffic is the pod's
	// outbound traffic).
	AnnotationRerouteVirtualInterfaces = "istio.io/reroute-virtual-interfaces"
)

// PodOptions derives a pod's capture options from the node's DNS capture
// default and the pod's annotations. Only "true" and "false" are valid
// annotation values; anything else is an error naming the annotation and the
// value, so a typo never silently changes capture.
func PodOptions(dnsCaptureDefault bool, annotations map[string]string) (iptables.PodOptions, error) {
	opts := iptables.PodOptions{DNSCapture: dnsCaptureDefault}
	if v, ok := annotations[AnnotationBypassInbound]; ok {
		b, err := parseBool(AnnotationBypassInbound, v)
		if err != nil {
			return iptables.PodOptions{}, err
		}
		opts.BypassInbound = b
	}
	if v, ok := annotations[AnnotationDNSCapture]; ok {
		b, err := parseBool(AnnotationDNSCapture, v)
		if err != nil {
			return iptables.PodOptions{}, err
		}
		opts.DNSCapture = b
	}
	if v, ok := annotations[AnnotationRerouteVirtualInterfaces]; ok {
		r, err := parseInterfaces(v)
		if err != nil {
			return iptables.PodOptions{}, err
		}
		opts.RerouteInterfaces = r
	}
	return opts, nil
}

// parseInterfaces turns "tap0, tap1" into the canonical "tap0,tap1"
// (spaces around names and empty items dropped), each name checked.
func parseInterfaces(v string) (string, error) {
	var names []string
	for _, f := range strings.Split(v, ",") {
		f = strings.TrimSpace(f)
		if f == "" || slices.Contains(names, f) {
			continue
		}
		if err := iptables.ValidInterfaceName(f); err != nil {
			return "", fmt.Errorf("annotation %s has invalid value %q: %w", AnnotationRerouteVirtualInterfaces, v, err)
		}
		names = append(names, f)
	}
	return strings.Join(names, ","), nil
}

func parseBool(name, v string) (bool, error) {
	switch v {
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, fmt.Errorf("annotation %s has invalid value %q: want \"true\" or \"false\"", name, v)
}
