package iptables

import (
	"fmt"
	"maps"
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestProbeCacheStale: the manager's copy of the probe sets goes stale
// behind its back (entries deleted with the backend's own tool, the whole
// set emptied); removal, a relabelling add and the prune still leave the
// kernel's set right, and the prune reports what it put back.
func TestProbeCacheStale(t *testing.T) {
	requireNFT(t)
	for _, mode := range []Mode{ModeNFT, ModeNFTables} {
		t.Run(string(mode), func(t *testing.T) { testProbeCacheStale(t, mode) })
	}
}

// delProbeEntry deletes ip from the IPv4 probe set with the backend's tool.
func delProbeEntry(t *testing.T, node ns.NetNS, mode Mode, ip string) {
	t.Helper()
	if mode == ModeNFTables {
		nsRun(t, node, "nft", "delete", "element", "inet", NFTTableNat, ProbeSetV4, "{ "+ip+" }")
		return
	}
	nsRun(t, node, "ipset", "del", ProbeSetV4, ip)
}

func testProbeCacheStale(t *testing.T, mode Mode) {
	ctx := testCtx(t)
	m := newTestManager(t, mode, Config{})
	node := newNS(t)
	inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
	inNode(t, node, "AddProbeIPs", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs("10.0.0.1")) })
	inNode(t, node, "AddProbeIPs", func() error { return m.AddProbeIPs(ctx, "uid-b", addrs("10.0.0.2")) })
	inNode(t, node, "AddProbeIPs", func() error { return m.AddProbeIPs(ctx, "uid-c", addrs("10.0.0.3")) })

	// Gone behind our back: removing uid-a's entry is no error; uid-b's IP
	// reused by uid-d (the copy says relabel, the kernel has nothing).
	delProbeEntry(t, node, mode, "10.0.0.1")
	delProbeEntry(t, node, mode, "10.0.0.2")
	inNode(t, node, "RemoveProbeIPs of a vanished entry", func() error { return m.RemoveProbeIPs(ctx, "uid-a", addrs("10.0.0.1")) })
	inNode(t, node, "AddProbeIPs relabelling a vanished entry", func() error { return m.AddProbeIPs(ctx, "uid-d", addrs("10.0.0.2")) })
	want := map[string]string{"10.0.0.2": "uid-d", "10.0.0.3": "uid-c"}
	if got := probeSets(t, m, node); !maps.Equal(got, want) {
		t.Fatalf("after stale-copy operations: %v, want %v", got, want)
	}

	// uid-c's entry vanishes: the prune reads the kernel and puts it back.
	delProbeEntry(t, node, mode, "10.0.0.3")
	var ch ProbeChanges
	inNode(t, node, "PruneProbeIPs", func() error {
		var err error
		ch, err = m.PruneProbeIPs(ctx, map[string][]netip.Addr{"uid-d": addrs("10.0.0.2"), "uid-c": addrs("10.0.0.3")})
		return err
	})
	if ch != (ProbeChanges{Added: 1}) {
		t.Errorf("prune changes %+v, want one added", ch)
	}
	if got := probeSets(t, m, node); !maps.Equal(got, want) {
		t.Fatalf("after prune: %v, want %v", got, want)
	}
}

// BenchmarkAddProbeIPs prints the time of one pod's AddProbeIPs (and
// RemoveProbeIPs) with 1,000 entries already in the probe set, per backend,
// in a throwaway netns: the step that grew with the node's pods while every
// call listed the whole set. The relist runs drop the manager's copy before
// each call, which costs what every call cost before the copy.
//
//	go test -run '^$' -bench AddProbeIPs -benchtime 200x ./iptables/
func BenchmarkAddProbeIPs(b *testing.B) {
	testutil.RequireIptables(b)
	for _, mode := range allModes {
		b.Run(string(mode), func(b *testing.B) { benchAddProbe(b, mode, false) })
		b.Run(string(mode)+"/relist", func(b *testing.B) { benchAddProbe(b, mode, true) })
	}
}

func benchAddProbe(b *testing.B, mode Mode, relist bool) {
	const entries = 1000
	ctx := testCtx(b)
	m := newTestManager(b, mode, Config{})
	node := newNS(b)
	do := func(what string, fn func() error) {
		b.Helper()
		if err := node.Do(func(ns.NetNS) error { return fn() }); err != nil {
			b.Fatalf("%s: %v", what, err)
		}
	}
	do("EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
	live := map[string][]netip.Addr{}
	for i := range entries {
		live[fmt.Sprintf("uid-%d", i)] = []netip.Addr{netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})}
	}
	do("fill the set", func() error { _, err := m.PruneProbeIPs(ctx, live); return err })
	var adds, removes []time.Duration
	b.ResetTimer()
	for i := range max(b.N, 50) {
		ip := []netip.Addr{netip.AddrFrom4([4]byte{10, 2, byte(i >> 8), byte(i)})}
		uid := fmt.Sprintf("uid-new-%d", i)
		if relist {
			m.dropProbeCache()
		}
		t0 := time.Now()
		do("AddProbeIPs", func() error { return m.AddProbeIPs(ctx, uid, ip) })
		if relist {
			m.dropProbeCache()
		}
		t1 := time.Now()
		do("RemoveProbeIPs", func() error { return m.RemoveProbeIPs(ctx, uid, ip) })
		adds, removes = append(adds, t1.Sub(t0)), append(removes, time.Since(t1))
	}
	b.StopTimer()
	am, ap := quantiles(adds)
	rm, rp := quantiles(removes)
	b.ReportMetric(am, "add-median-ms")
	b.ReportMetric(rm, "remove-median-ms")
	b.Logf("%s relist=%v, %d entries in the set: AddProbeIPs median %.3f ms p90 %.3f ms; RemoveProbeIPs median %.3f ms p90 %.3f ms", mode, relist, entries, am, ap, rm, rp)
}
