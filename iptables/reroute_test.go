package iptables

import (
	"fmt"
	"net/netip"
	"testing"
)

// TestTrafficPodReroute: a pod's own reroute interface (KubeVirt's tap,
// from its istio.io/reroute-virtual-interfaces) sends TCP arriving on it to
// ztunnel's outbound port with the original destination, with every
// backend; without the option the same connection is inbound traffic (15006).
func TestTrafficPodReroute(t *testing.T) {
	requireNFT(t)
	for _, mode := range allModes {
		t.Run(string(mode), func(t *testing.T) { testPodReroute(t, mode) })
	}
}

func testPodReroute(t *testing.T, mode Mode) {
	ctx := testCtx(t)
	m := newTestManager(t, mode, Config{})
	// The "VM" sits behind the pod's eth0 (its tap in KubeVirt) and routes
	// everything through the pod.
	pod, vm := newNS(t), newNS(t)
	vethPair(t, pod, vm, []netip.Addr{podIP}, []netip.Addr{peerIP})
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", OutboundPort), "ztunnel-outbound", true)
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", InboundPort), "ztunnel-inbound", true)
	dst := netip.AddrPortFrom(netip.MustParseAddr("10.99.0.1"), peerPort) // beyond the pod

	for _, tc := range []struct {
		opts PodOptions
		want string
	}{
		{PodOptions{RerouteInterfaces: "eth0"}, "ztunnel-outbound|" + dst.String() + "|" + peerIP.String()},
		{PodOptions{}, "ztunnel-inbound|" + dst.String() + "|" + peerIP.String()},
		{PodOptions{RerouteInterfaces: "tap9,eth0"}, "ztunnel-outbound|" + dst.String() + "|" + peerIP.String()},
	} {
		if err := m.ApplyPod(ctx, pod, tc.opts); err != nil {
			t.Fatalf("ApplyPod(%+v): %v", tc.opts, err)
		}
		if d, err := m.VerifyPod(ctx, pod, tc.opts); err != nil || !d.Empty() {
			t.Fatalf("VerifyPod(%+v) after apply: %v, %s", tc.opts, err, d)
		}
		got, err := ask(vm, "tcp4", dst, dialOpts{})
		if err != nil || got != tc.want {
			t.Errorf("options %+v: VM's connection to %s answered %q (%v), want %q", tc.opts, dst, got, err, tc.want)
		}
	}
	if err := m.DeletePod(ctx, pod); err != nil {
		t.Fatalf("DeletePod: %v", err)
	}
}
