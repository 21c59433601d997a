package iptables

import (
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/testutils"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// benchSidecarOptions is an injected pod with the chart's defaults plus DNS
// capture, dual-stack (ISTIO_DUAL_STACK): the largest common sidecar rule
// set, beside BenchmarkPodRules' full ambient set.
var benchSidecarOptions = SidecarOptions{
	Mode: InterceptRedirect, ProxyUID: 1337, ProxyGID: 1337,
	IncludeAllOutbound: true, IncludeAllInbound: true,
	ExcludeInboundPorts: []uint16{15020, 15021, 15090}, ExcludeOutboundPorts: []uint16{15020},
	DNS: true, IPv6: true,
}

// BenchmarkSidecarRules measures apply (the rule part of a sidecar pod's
// CNI ADD), verify (the drift pass's read) and delete of a sidecar pod's
// rules in a fresh netns per pod, for every backend; median and p90 per pod
// in milliseconds, as BenchmarkPodRules reports the ambient rules.
//
//	go test -run '^$' -bench 'PodRules|SidecarRules' -benchtime 40x ./iptables/
func BenchmarkSidecarRules(b *testing.B) {
	testutil.RequireIptables(b)
	for _, mode := range allModes {
		b.Run(string(mode), func(b *testing.B) {
			ctx := testCtx(b)
			m := newTestManager(b, mode, Config{IPv6: true})
			o := benchSidecarOptions
			var applies, verifies, deletes []time.Duration
			b.ResetTimer()
			for i := 0; i < max(b.N, minPods); i++ {
				b.StopTimer()
				pod, err := testutils.NewNS()
				if err != nil {
					b.Fatal(err)
				}
				if err := testutil.LoUp(pod); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				t0 := time.Now()
				if err := m.ApplySidecar(ctx, pod, o, nil); err != nil {
					b.Fatalf("apply: %v", err)
				}
				t1 := time.Now()
				d, err := m.VerifySidecar(ctx, pod, o)
				if err != nil || !d.Empty() {
					b.Fatalf("verify: %v %s", err, d)
				}
				t2 := time.Now()
				if err := m.DeleteSidecar(ctx, pod, &o); err != nil {
					b.Fatalf("delete: %v", err)
				}
				t3 := time.Now()
				b.StopTimer()
				applies, verifies, deletes = append(applies, t1.Sub(t0)), append(verifies, t2.Sub(t1)), append(deletes, t3.Sub(t2))
				pod.Close()
				if err := testutils.UnmountNS(pod); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.StopTimer()
			am, ap := quantiles(applies)
			vm, vp := quantiles(verifies)
			dm, dp := quantiles(deletes)
			b.ReportMetric(am, "apply-median-ms")
			b.ReportMetric(ap, "apply-p90-ms")
			b.ReportMetric(vm, "verify-median-ms")
			b.ReportMetric(vp, "verify-p90-ms")
			b.ReportMetric(dm, "delete-median-ms")
			b.ReportMetric(dp, "delete-p90-ms")
			b.Logf("%d pods: apply median %.2f ms p90 %.2f ms; verify median %.2f ms p90 %.2f ms; delete median %.2f ms p90 %.2f ms",
				len(applies), am, ap, vm, vp, dm, dp)
		})
	}
}
