package iptables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/xtables"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// foreign adds rules that are not ours to n, before and after we apply, so
// delete can be shown to leave them alone.
func addForeign(t *testing.T, n ns.NetNS, f Family, mode Mode, tag string) {
	t.Helper()
	ipt := tool(f, mode, "")
	nsRun(t, n, ipt, "-w", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9999", "-m", "comment", "--comment", tag, "-j", "ACCEPT")
	nsRun(t, n, ipt, "-w", "-t", "mangle", "-N", "FOREIGN_"+tag)
	nsRun(t, n, ipt, "-w", "-t", "mangle", "-A", "PREROUTING", "-j", "FOREIGN_"+tag)
}

func foreignPresent(save, tag string) bool {
	return strings.Contains(save, "-A OUTPUT -p udp -m udp --dport 9999 -m comment --comment "+tag+" -j ACCEPT") &&
		strings.Contains(save, ":FOREIGN_"+tag+" - ") &&
		strings.Contains(save, "-A PREROUTING -j FOREIGN_"+tag)
}

func TestPodRulesInNetns(t *testing.T) {
	testutil.RequireIptables(t)
	for _, mode := range modes {
		for _, c := range goldenPodCases() {
			if !strings.HasPrefix(c.name, "pod_v6") && !strings.HasSuffix(c.name, "reroute") {
				continue // the v6 cases apply v4 too: every golden file is checked
			}
			t.Run(string(mode)+"/"+c.name, func(t *testing.T) {
				testPodRules(t, mode, c)
			})
		}
	}
}

func testPodRules(t *testing.T, mode Mode, c goldenCase) {
	ctx := testCtx(t)
	m := newTestManager(t, mode, c.cfg)
	pod := newNS(t)
	rs := BuildPodRules(c.cfg, c.opts)
	for _, f := range rs.Families() {
		addForeign(t, pod, f, mode, "before")
	}

	if err := m.ApplyPod(ctx, pod, c.opts); err != nil {
		t.Fatalf("ApplyPod: %v", err)
	}
	for _, f := range rs.Families() {
		addForeign(t, pod, f, mode, "after")
	}

	// iptables-save of this variant holds exactly the golden rules.
	saves := map[Family]string{}
	for _, f := range rs.Families() {
		name := c.name
		if f == IPv4 {
			name = strings.Replace(name, "_v6_", "_v4_", 1)
		}
		golden, err := os.ReadFile(filepath.Join("testdata", name+".golden"))
		if err != nil {
			t.Fatal(err)
		}
		saves[f] = saveText(t, pod, f, mode)
		got, want := ours(saves[f], rs), ours(string(golden), rs)
		if len(want) == 0 || !reflect.DeepEqual(got, want) {
			t.Fatalf("%s-save after apply differs from %s.golden\ngot  %q\nwant %q\nfull save:\n%s", f, name, got, want, saves[f])
		}
		if !foreignPresent(saves[f], "before") {
			t.Fatalf("apply removed a foreign rule:\n%s", saves[f])
		}
	}
	d, err := m.VerifyPod(ctx, pod, c.opts)
	if err != nil || !d.Empty() {
		t.Fatalf("VerifyPod after apply: %v, %s", err, d)
	}

	// Apply again: nothing changes.
	if err := m.ApplyPod(ctx, pod, c.opts); err != nil {
		t.Fatalf("second ApplyPod: %v", err)
	}
	for _, f := range rs.Families() {
		if again := saveText(t, pod, f, mode); again != saves[f] {
			t.Fatalf("second apply changed %s rules:\nbefore:\n%s\nafter:\n%s", f, saves[f], again)
		}
	}

	// Drift behind our back: a rule deleted, a stray rule added, the ip rule gone.
	last := rs.V4[len(rs.V4)-1]
	for _, r := range rs.V4 {
		if r.Table == "nat" && r.Chain == xtables.ChainOutput {
			last = r
		}
	}
	nsRun(t, pod, tool(IPv4, mode, ""), append([]string{"-w", "-t", last.Table, "-D", last.Chain}, last.Args...)...)
	nsRun(t, pod, tool(IPv4, mode, ""), "-w", "-t", "mangle", "-A", xtables.ChainPrerouting, "-p", "sctp", "-j", "ACCEPT")
	nsRun(t, pod, "ip", "rule", "del", "fwmark", "0x111/0xfff", "lookup", "100")
	// VerifyPod names exactly that; apply repairs it.
	checkDriftRepaired(t, m, pod, c.opts,
		[]string{"ip rule pref 32764 fwmark 0x111/0xfff lookup 100", "iptables -t " + last.Table + " " + last.Spec()},
		[]string{"iptables -t mangle -A ISTIO_PRERT -p sctp -j ACCEPT"})

	// Delete: nothing of ours left, foreign rules untouched; again is fine.
	for i := 0; i < 2; i++ {
		if err := m.DeletePod(ctx, pod); err != nil {
			t.Fatalf("DeletePod #%d: %v", i+1, err)
		}
		for _, f := range rs.Families() {
			s := saveText(t, pod, f, mode)
			if strings.Contains(s, "ISTIO_") {
				t.Fatalf("%s rules of ours left after delete:\n%s", f, s)
			}
			if !foreignPresent(s, "before") || !foreignPresent(s, "after") {
				t.Fatalf("delete removed foreign %s rules:\n%s", f, s)
			}
		}
		rules := nsRun(t, pod, "ip", "rule") + nsRun(t, pod, "ip", "-6", "rule")
		routes := nsRun(t, pod, "ip", "route", "show", "table", "all") + nsRun(t, pod, "ip", "-6", "route", "show", "table", "all")
		if strings.Contains(rules, "0x111") || strings.Contains(routes, "table 100") {
			t.Fatalf("policy route left after delete:\n%s\n%s", rules, routes)
		}
	}
	d, err = m.VerifyPod(ctx, pod, c.opts)
	if err != nil || d.Empty() || len(d.Unexpected) != 0 {
		t.Fatalf("VerifyPod after delete should report everything missing, nothing unexpected: %v %s", err, d)
	}
}

// TestPolicyRouteInNetns checks the route and rule ApplyPod installs, as ip
// prints them, for both families.
func TestPolicyRouteInNetns(t *testing.T) {
	testutil.RequireIptables(t)
	ctx := testCtx(t)
	m := newTestManager(t, ModeNFT, Config{IPv6: true})
	pod := newNS(t)
	if err := m.ApplyPod(ctx, pod, PodOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, check := range []struct {
		args []string
		want string
	}{
		{[]string{"rule"}, "32764:\tfrom all fwmark 0x111/0xfff lookup 100"},
		{[]string{"-6", "rule"}, "32764:\tfrom all fwmark 0x111/0xfff lookup 100"},
		{[]string{"route", "show", "table", "100"}, "local default dev lo scope host"},
		{[]string{"-6", "route", "show", "table", "100"}, "local default dev lo"},
	} {
		if out := nsRun(t, pod, "ip", check.args...); !strings.Contains(out, check.want) {
			t.Errorf("ip %s:\n%s\nwant a line containing %q", strings.Join(check.args, " "), out, check.want)
		}
	}
}

// TestBadInput: errors are clear, nothing leaks.
func TestBadInput(t *testing.T) {
	testutil.RequireIptables(t)
	ctx := testCtx(t)
	if _, err := NewManager(ctx, Config{Mode: "xtables"}, nil); err == nil || !strings.Contains(err.Error(), `"xtables"`) {
		t.Errorf("NewManager with a bad mode: %v", err)
	}
	m := newTestManager(t, ModeNFT, Config{})
	pod := newNS(t)
	gone, fresh := newNS(t), newNS(t)
	fds, goroutines := testutil.CountFDs(t), runtime.NumGoroutine()

	// lo down: refused before any rule is written.
	nsRun(t, pod, "ip", "link", "set", "lo", "down")
	err := m.ApplyPod(ctx, pod, PodOptions{})
	if err == nil || !strings.Contains(err.Error(), "lo is down") || !strings.Contains(err.Error(), pod.Path()) {
		t.Errorf("ApplyPod with lo down: %v", err)
	}
	if s := saveText(t, pod, IPv4, ModeNFT); strings.Contains(s, "ISTIO_") {
		t.Errorf("rules written although apply failed:\n%s", s)
	}

	// A closed namespace handle.
	gone.Close()
	if err := m.ApplyPod(ctx, gone, PodOptions{}); err == nil {
		t.Error("ApplyPod on a closed netns succeeded")
	}
	if err := m.DeletePod(ctx, gone); err == nil {
		t.Error("DeletePod on a closed netns succeeded")
	}
	// An IPv6 address without IPv6, a bad address, an empty uid.
	if err := m.AddProbeIPs(ctx, "u", nil); err != nil {
		t.Errorf("AddProbeIPs with no IPs: %v", err)
	}
	if err := m.AddProbeIPs(ctx, "", nil); err == nil {
		t.Error("AddProbeIPs with an empty uid succeeded")
	}
	// A cancelled context: refused promptly, nothing written.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := m.ApplyPod(cancelled, fresh, PodOptions{}); err == nil || !errors.Is(err, context.Canceled) && !strings.Contains(err.Error(), "context canceled") {
		t.Errorf("ApplyPod with a cancelled context: %v", err)
	}
	if s := saveText(t, fresh, IPv4, ModeNFT); strings.Contains(s, "ISTIO_") {
		t.Errorf("rules written with a cancelled context:\n%s", s)
	}
	m.WaitIdle() // netlink sockets released in the background
	if after := testutil.CountFDs(t); after > fds {
		t.Errorf("file descriptors leaked: %d before, %d after", fds, after)
	}
	// Goroutines of finished processes wind down; wait for that, bounded.
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > goroutines && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > goroutines {
		t.Errorf("goroutines leaked: %d before, %d after", goroutines, n)
	}
}

// TestProcessBudget holds each operation to its process budget: one restore
// per family to apply to a fresh pod and to delete, one save per family to
// verify, save-only for a re-apply that finds nothing to change.
func TestProcessBudget(t *testing.T) {
	testutil.RequireIptables(t)
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) {
			ctx := testCtx(t)
			m := newTestManager(t, mode, Config{IPv6: true})
			pod := newNS(t)
			opts := PodOptions{DNSCapture: true}
			steps := []struct {
				name string
				do   func() error
				want int64
			}{
				{"apply fresh", func() error { return m.ApplyPod(ctx, pod, opts) }, 2},
				{"verify", func() error {
					d, err := m.VerifyPod(ctx, pod, opts)
					if err == nil && !d.Empty() {
						err = fmt.Errorf("drift: %s", d)
					}
					return err
				}, 2},
				{"apply again (no change)", func() error { return m.ApplyPod(ctx, pod, opts) }, 4},
				{"delete", func() error { return m.DeletePod(ctx, pod) }, 2},
				{"delete again (nothing left)", func() error { return m.DeletePod(ctx, pod) }, 4},
			}
			for _, s := range steps {
				before := m.spawned.Load()
				if err := s.do(); err != nil {
					t.Fatalf("%s: %v", s.name, err)
				}
				if got := m.spawned.Load() - before; got != s.want {
					t.Errorf("%s spawned %d processes, want %d", s.name, got, s.want)
				}
			}
		})
	}
}

// TestDetectMode: the iptables variant auto falls back to (no nftables)
// follows the one that holds rules in the current namespace (the node's),
// nft when neither or both hold the same count.
func TestDetectMode(t *testing.T) {
	testutil.RequireIptables(t)
	tests := []struct {
		name   string
		legacy int // rules put in with iptables-legacy
		nft    int
		want   Mode
	}{
		{"empty node", 0, 0, ModeNFT},
		{"legacy node", 3, 0, ModeLegacy},
		{"nft node", 0, 2, ModeNFT},
		{"mostly legacy", 3, 1, ModeLegacy},
		{"mostly nft", 1, 3, ModeNFT},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := newNS(t)
			for mode, n := range map[Mode]int{ModeLegacy: tt.legacy, ModeNFT: tt.nft} {
				for i := 0; i < n; i++ {
					nsRun(t, node, tool(IPv4, mode, ""), "-w", "-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", fmt.Sprint(1000+i), "-j", "ACCEPT")
				}
			}
			var got Mode
			err := node.Do(func(ns.NetNS) error {
				m := &Manager{cfg: Config{}.withDefaults(), log: slog.New(slog.DiscardHandler)}
				var err error
				got, err = m.detect(testCtx(t))
				return err
			})
			if err != nil || got != tt.want {
				t.Fatalf("detected %q (err %v), want %q", got, err, tt.want)
			}
		})
	}
}
