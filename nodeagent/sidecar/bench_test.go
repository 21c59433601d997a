package sidecar_test

import (
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/testutils"
	"k8s.io/apimachinery/pkg/types"

	tu "github.com/ambientd/ambientd/test/infra/testutil"
)

// BenchmarkSidecarCapture measures sidecar mode's whole CNI ADD step in the
// agent (the CNI edge opens the runtime's netns, Tracker.Capture reads the
// pod and programs the rules), per backend, for the golden dual-stack pod
// with DNS capture off and the golden DNS-capture pod; median and p90 per
// pod.
//
//	go test -run '^$' -bench SidecarCapture -benchtime 40x ./nodeagent/sidecar/
func BenchmarkSidecarCapture(b *testing.B) {
	tu.RequireIptables(b, "nft")
	for _, mode := range allModes {
		for _, golden := range []string{"dualstack", "dns-capture"} {
			b.Run(string(mode)+"/"+golden, func(b *testing.B) {
				ctx := testCtx(b)
				m := newManager(b, mode)
				pod, c := sidecarPod(b, golden, "bench")
				env := newTracker(b, m, b.TempDir(), pod).tr
				var adds []time.Duration
				b.ResetTimer()
				for i := 0; i < max(b.N, 15); i++ {
					b.StopTimer()
					n, err := testutils.NewNS()
					if err != nil {
						b.Fatal(err)
					}
					if err := tu.LoUp(n); err != nil {
						b.Fatal(err)
					}
					pod.UID = types.UID("bench-" + string(rune('a'+i%26)))
					b.StartTimer()
					t0 := time.Now()
					if err := captureAt(ctx, env, pod, n.Path(), c.IPs()); err != nil {
						b.Fatal(err)
					}
					adds = append(adds, time.Since(t0))
					b.StopTimer()
					n.Close()
					if err := testutils.UnmountNS(n); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				b.StopTimer()
				med, p90 := quantiles(adds)
				b.ReportMetric(med, "add-median-ms")
				b.ReportMetric(p90, "add-p90-ms")
				b.Logf("%d pods: sidecar ADD median %.2f ms p90 %.2f ms", len(adds), med, p90)
			})
		}
	}
}

func quantiles(d []time.Duration) (median, p90 float64) {
	s := slices.Clone(d)
	slices.Sort(s)
	ms := func(x time.Duration) float64 { return float64(x) / float64(time.Millisecond) }
	return ms(s[len(s)/2]), ms(s[(len(s)*9)/10])
}
