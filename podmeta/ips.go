package podmeta

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"
)

// IPs returns the pod's addresses as kubelet reports them (status.podIPs,
// else the older status.podIP), unmapped; unparsable entries are skipped.
// It is the one reading of a pod's addresses from the API: the agent's
// sandbox checks and sidecar mode compare what it returns with the CNI
// ADD's addresses.
func IPs(p *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && p.Status.PodIP != "" {
		if a, err := netip.ParseAddr(p.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}
