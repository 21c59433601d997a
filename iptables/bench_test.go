package iptables

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// BenchmarkPodRules measures apply, verify and delete of the full in-pod rule
// set (IPv4 and IPv6, DNS capture, policy route) in a fresh netns per pod, for
// every backend side by side: native nftables over netlink, our
// iptables-restore batches (one per family) of both variants, and the naive
// way (one iptables process per rule); it reports the median and p90 per pod
// in milliseconds.
//
// Every run measures at least minPods pods so medians mean something even
// under the default -benchtime; ns/op is reported as the mean apply+delete
// time per pod (namespace creation excluded).
//
//	go test -run '^$' -bench PodRules -benchtime 40x ./iptables/
func BenchmarkPodRules(b *testing.B) {
	testutil.RequireIptables(b)
	b.Run("nftables/netlink", func(b *testing.B) { benchPod(b, ModeNFTables, false) })
	for _, mode := range modes {
		for _, way := range []string{"batch", "naive"} {
			b.Run(string(mode)+"/"+way, func(b *testing.B) { benchPod(b, mode, way == "naive") })
		}
	}
}

const minPods = 15

func benchPod(b *testing.B, mode Mode, naive bool) {
	ctx := testCtx(b)
	cfg := Config{IPv6: true}
	m := newTestManager(b, mode, cfg)
	opts := PodOptions{DNSCapture: true}
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
		if naive {
			err = naiveApply(ctx, m, pod, opts)
		} else {
			err = m.ApplyPod(ctx, pod, opts)
		}
		if err != nil {
			b.Fatalf("apply: %v", err)
		}
		t1 := time.Now()
		// Recorded now: t1 moves past the verify below, which is timed on
		// its own (the apply figure once included it).
		applies = append(applies, t1.Sub(t0))
		if !naive {
			// The drift pass's read: one verify per pod (naive has none).
			d, err := m.VerifyPod(ctx, pod, opts)
			if err != nil || !d.Empty() {
				b.Fatalf("verify: %v %s", err, d)
			}
			verifies = append(verifies, time.Since(t1))
			t1 = time.Now()
		}
		if naive {
			err = naiveDelete(ctx, m, pod)
		} else {
			err = m.DeletePod(ctx, pod)
		}
		if err != nil {
			b.Fatalf("delete: %v", err)
		}
		t2 := time.Now()

		b.StopTimer()
		deletes = append(deletes, t2.Sub(t1))
		pod.Close()
		if err := testutils.UnmountNS(pod); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	var total time.Duration
	for i := range applies {
		total += applies[i] + deletes[i]
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(len(applies)), "ns/op")
	am, ap := quantiles(applies)
	dm, dp := quantiles(deletes)
	b.ReportMetric(am, "apply-median-ms")
	b.ReportMetric(ap, "apply-p90-ms")
	b.ReportMetric(dm, "delete-median-ms")
	b.ReportMetric(dp, "delete-p90-ms")
	if len(verifies) > 0 {
		vm, vp := quantiles(verifies)
		b.ReportMetric(vm, "verify-median-ms")
		b.ReportMetric(vp, "verify-p90-ms")
		b.Logf("%d pods: apply median %.2f ms p90 %.2f ms; verify median %.2f ms p90 %.2f ms; delete median %.2f ms p90 %.2f ms", len(applies), am, ap, vm, vp, dm, dp)
		return
	}
	b.Logf("%d pods: apply median %.1f ms p90 %.1f ms; delete median %.1f ms p90 %.1f ms", len(applies), am, ap, dm, dp)
}

func quantiles(d []time.Duration) (median, p90 float64) {
	s := slices.Clone(d)
	slices.Sort(s)
	ms := func(x time.Duration) float64 { return float64(x) / float64(time.Millisecond) }
	return ms(s[len(s)/2]), ms(s[(len(s)*9)/10])
}

// naiveCommands lists one iptables invocation per rule, the way a
// configurator without restore batches does it.
func naiveCommands(rs RuleSet, f Family, del bool) [][]string {
	var cmds [][]string
	for _, t := range rs.Tables {
		if del {
			for _, j := range rs.Jumps {
				if j.Table == t {
					cmds = append(cmds, []string{"-t", t, "-D", j.From, "-j", j.To})
				}
			}
			for _, c := range rs.Chains(t) {
				cmds = append(cmds, []string{"-t", t, "-F", c}, []string{"-t", t, "-X", c})
			}
			continue
		}
		for _, c := range rs.Chains(t) {
			cmds = append(cmds, []string{"-t", t, "-N", c})
		}
		for _, r := range rs.Rules(f) {
			if r.Table == t {
				cmds = append(cmds, append([]string{"-t", t, "-A", r.Chain}, r.Args...))
			}
		}
		for _, j := range rs.Jumps {
			if j.Table == t {
				cmds = append(cmds, []string{"-t", t, "-A", j.From, "-j", j.To})
			}
		}
	}
	return cmds
}

func naiveRun(ctx context.Context, m *Manager, pod ns.NetNS, rs RuleSet, del bool) error {
	return pod.Do(func(ns.NetNS) error {
		for _, f := range rs.Families() {
			for _, args := range naiveCommands(rs, f, del) {
				bin := tool(f, m.Mode(), "")
				if out, err := exec.CommandContext(ctx, bin, append([]string{"-w"}, args...)...).CombinedOutput(); err != nil {
					return fmt.Errorf("%s %v: %w: %s", bin, args, err, out)
				}
			}
		}
		return nil
	})
}

func naiveApply(ctx context.Context, m *Manager, pod ns.NetNS, opts PodOptions) error {
	if err := pod.Do(func(ns.NetNS) error { return ensurePolicyRoute(m.cfg.IPv6) }); err != nil {
		return err
	}
	return naiveRun(ctx, m, pod, BuildPodRules(m.cfg, opts), false)
}

func naiveDelete(ctx context.Context, m *Manager, pod ns.NetNS) error {
	if err := naiveRun(ctx, m, pod, BuildPodRules(m.cfg, PodOptions{}), true); err != nil {
		return err
	}
	return pod.Do(func(ns.NetNS) error { return deletePolicyRoute() })
}
