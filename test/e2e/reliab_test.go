//go:build e2e

package e2e

// End-to-end tests of "no silent bypass, no black hole": a pod
// annotated `enabled` must have its traffic captured, and captured traffic
// must have a ztunnel behind it — across agent restarts, rule drift, ztunnel
// re-adds and IPv6.

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// wipeRules wipes the pod's rules (e2eenv's Pod.WipeRules) and checks none
// of ours is left.
func wipeRules(t *testing.T, p *e2eenv.Pod) {
	t.Helper()
	if err := p.WipeRules(); err != nil {
		t.Fatal(err)
	}
	if r := podRules(t, p); r != "" {
		t.Fatalf("rules left after wiping pod %s:\n%s", p.Name, r)
	}
}

// acceptedFrom counts the connections the emulator accepted from pod uid.
func acceptedFrom(st ztunnelemu.State, uid string) int {
	n := 0
	for _, r := range st.Accepted {
		if r.UID == uid {
			n++
		}
	}
	return n
}

// requireCaptured dials dst from the pod and waits until em accepted the
// connection on 15001 with dst as the original destination.
func requireCaptured(t *testing.T, ctx context.Context, em *e2eenv.Emulator, p *e2eenv.Pod, dst string) {
	t.Helper()
	before := acceptedFrom(emuState(t, ctx, em), p.UID)
	dialOnce(t, ctx, p, dst)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st := waitEmu(t, wctx, em, "captured connection from pod "+p.Name+" to "+dst, func(s ztunnelemu.State) bool {
		return acceptedFrom(s, p.UID) > before
	})
	var last ztunnelemu.AcceptRecord
	for _, r := range st.Accepted {
		if r.UID == p.UID {
			last = r
		}
	}
	if last.Port != 15001 || last.OrigDst != dst {
		t.Errorf("pod %s: accepted %+v, want port 15001 and original destination %s", p.Name, last, dst)
	}
}

// dialOnce connects from pod from to dst and closes the connection: with
// capture, the emulator's listener answers whatever dst is.
func dialOnce(t *testing.T, ctx context.Context, from *e2eenv.Pod, dst string) {
	t.Helper()
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := from.Dial(dctx, "tcp", dst)
	if err != nil {
		t.Fatalf("dial %s from pod %s: %v (traffic not captured?)", dst, from.Name, err)
	}
	conn.Close()
}

// TestRestartRepairsWipedRules: rules wiped in an
// enrolled pod while the agent is down are back by the time the restarted
// agent serves (the verification is part of its rebuild), its traffic is
// captured again; an intact pod's rules are not rewritten (byte-identical,
// and the agent ran exactly one rule write: the repair).
func TestRestartRepairsWipedRules(t *testing.T) {
	s := newScenario(t, "rverify", within(5*time.Minute), agentEnv(xtablesBackend))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	wiped := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "wiped"})
	intact := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "intact"})
	waitAnnotation(t, ctx, wiped, "enabled")
	waitAnnotation(t, ctx, intact, "enabled")
	wantWiped, wantIntact := podRules(t, wiped), podRules(t, intact)

	if err := a.Kill(); err != nil {
		t.Fatalf("SIGKILL agent: %v", err)
	}
	wipeRules(t, wiped)
	startAndAwaitSnapshot(t, ctx, a, em)
	// The agent serves only after its rebuild, which verifies: no window.
	if got := podRules(t, wiped); got != wantWiped {
		t.Fatalf("wiped pod's rules not restored when the agent serves again:\ngot:\n%s\nwant:\n%s", got, wantWiped)
	}
	if got := podRules(t, intact); got != wantIntact {
		t.Errorf("intact pod's rules changed across the restart:\ngot:\n%s\nwant:\n%s", got, wantIntact)
	}
	if n := metricValue(t, ctx, a, "ambientd_pod_rule_writes_total", ""); n != 1 {
		t.Errorf("agent wrote pod rules %v times after the restart, want 1 (the wiped pod only)", n)
	}
	if n := metricValue(t, ctx, a, "ambientd_repairs_total", `what="pod_rules"`); n != 1 {
		t.Errorf("ambientd_repairs_total{what=pod_rules} = %v, want 1", n)
	}
	for _, p := range []*e2eenv.Pod{wiped, intact} {
		if v, _ := annotationOf(t, ctx, p); v != "enabled" {
			t.Errorf("pod %s annotation %q after restart, want enabled", p.Name, v)
		}
	}
	requireCaptured(t, ctx, em, wiped, outsideAddr())
}

// TestDriftRepairedWhileRunning (Must show 2): rules wiped while the agent
// runs are repaired by the drift pass (short interval), counted, and the
// pod's traffic is captured again.
func TestDriftRepairedWhileRunning(t *testing.T) {
	s := newScenario(t, "drift", agentEnv(xtablesBackend, "AMBIENTD_VERIFY_INTERVAL=1s"))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "drifty"})
	waitAnnotation(t, ctx, p, "enabled")
	want := podRules(t, p)

	wipeRules(t, p)
	testutil.Until(t, ctx, "drift pass restoring the pod's rules", func() bool { return podRules(t, p) == want })
	testutil.Until(t, ctx, "repair counted", func() bool {
		return metricValue(t, ctx, a, "ambientd_repairs_total", `what="pod_rules"`) >= 1
	})
	if v, _ := annotationOf(t, ctx, p); v != "enabled" {
		t.Errorf("annotation %q after repair, want enabled", v)
	}
	requireCaptured(t, ctx, em, p, outsideAddr())
}

// TestDriftRepairEventVisible ("Events visible through the API
// for a repair"): a drift repair while the agent runs is a RulesRepaired
// Warning Event on the pod, read through the API, and is counted in
// ambientd_repairs_total{what="pod_rules"}.
func TestDriftRepairEventVisible(t *testing.T) {
	s := newScenario(t, "driftev", agentEnv(xtablesBackend, "AMBIENTD_VERIFY_INTERVAL=1s"))
	ctx, nsName, a := s.ctx, s.ns, s.agent
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "drifted"})
	waitAnnotation(t, ctx, p, "enabled")
	before := metricValue(t, ctx, a, "ambientd_repairs_total", `what="pod_rules"`)

	wipeRules(t, p)
	evs := podEvents(t, ctx, p, agent.EventRulesRepaired)
	for _, e := range evs {
		if e.Type != corev1.EventTypeWarning || !strings.Contains(e.Message, "missing") {
			t.Errorf("RulesRepaired Event %s %q: want a Warning naming what was missing", e.Type, e.Message)
		}
	}
	testutil.Until(t, ctx, "repair counted", func() bool {
		return metricValue(t, ctx, a, "ambientd_repairs_total", `what="pod_rules"`) >= before+1
	})
}

// TestReaddToRemainingZtunnel (Must show 3): two ztunnels connected, a new
// pod goes to the newest; when that one stops, the remaining one gets the
// pod's Add (time printed; target 1 s) and serves its traffic.
func TestReaddToRemainingZtunnel(t *testing.T) {
	s := newScenario(t, "readd")
	ctx, nsName, old := s.ctx, s.ns, s.em
	waitEmu(t, ctx, old, "first ztunnel's snapshot", func(s ztunnelemu.State) bool {
		return len(s.Connections) > 0 && s.Connections[len(s.Connections)-1].SnapshotSent
	})
	newer, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: "ztunnel-new"})
	if err != nil {
		t.Fatalf("start second emulator: %v", err)
	}
	newer.LogOnFailure(t)
	t.Cleanup(func() { newer.Stop(10 * time.Second) })
	waitEmu(t, ctx, newer, "second ztunnel's snapshot", func(s ztunnelemu.State) bool {
		return len(s.Connections) > 0 && s.Connections[len(s.Connections)-1].SnapshotSent
	})

	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "moved"})
	waitAnnotation(t, ctx, p, "enabled")
	waitEmu(t, ctx, newer, "the pod on the newest ztunnel", func(s ztunnelemu.State) bool { _, ok := s.Workload(p.UID); return ok })
	if _, ok := emuState(t, ctx, old).Workload(p.UID); ok {
		t.Fatalf("the older ztunnel got the new pod too; the test needs it on the newest only")
	}

	stopped := time.Now()
	if err := newer.Stop(10 * time.Second); err != nil {
		t.Fatalf("stop newest emulator: %v", err)
	}
	st := waitEmu(t, ctx, old, "the pod handed over to the remaining ztunnel", func(s ztunnelemu.State) bool { _, ok := s.Workload(p.UID); return ok })
	t.Logf("re-add: remaining ztunnel has the pod %v after the newest was stopped (target 1s)", time.Since(stopped).Round(time.Millisecond))
	w, _ := st.Workload(p.UID)
	if want := netnsInode(t, p); w.NetnsInode != want {
		t.Errorf("re-add's Add carried netns inode %d, want %d", w.NetnsInode, want)
	}
	requireCaptured(t, ctx, old, p, outsideAddr())
	if v, _ := annotationOf(t, ctx, p); v != "enabled" {
		t.Errorf("annotation %q after the re-add, want enabled", v)
	}
}

// TestDualStackIPv6Captured (Must show 4): a dual-stack pod (host-local with
// an IPv6 range) enrolled with the default flags has its IPv6 TCP captured.
func TestDualStackIPv6Captured(t *testing.T) {
	s := newScenario(t, "dual", withoutZtunnel(), withoutAgent())
	ctx, nsName := s.ctx, s.ns
	subnet6 := netip.MustParsePrefix("fd00:88::/64")
	chain, err := testEnv.Chain.DualStack(subnet6, "30-dual.conflist")
	if err != nil {
		t.Fatal(err)
	}
	em := startEmulator(t, ctx, "ztunnel-dual")
	startAgent(t, ctx)
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "dual", Chain: chain})
	if !slices.ContainsFunc(p.IPs, func(a netip.Addr) bool { return a.Is6() }) {
		t.Fatalf("pod got no IPv6 address from the dual-stack chain: %v", p.IPs)
	}
	waitAnnotation(t, ctx, p, "enabled")
	dst6 := subnet6.Addr()
	for range 250 {
		dst6 = dst6.Next()
	}
	requireCaptured(t, ctx, em, p, netip.AddrPortFrom(dst6, 8080).String())
	requireCaptured(t, ctx, em, p, outsideAddr())
}

// natPostrouting returns the node's nat POSTROUTING rules (both variants).
func natPostrouting(t *testing.T) string {
	t.Helper()
	var out []string
	for _, tool := range []string{"iptables-legacy", "iptables-nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			continue
		}
		b, err := exec.Command(tool, "-w", "-t", "nat", "-S", "POSTROUTING").CombinedOutput()
		if err != nil {
			t.Fatalf("%s -t nat -S POSTROUTING: %v: %s", tool, err, b)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "-A ") {
				out = append(out, tool+": "+l)
			}
		}
	}
	return strings.Join(out, "\n")
}

// probeSetHas reports whether the node's IPv4 probe ipset holds ip.
func probeSetHas(t *testing.T, ip netip.Addr) bool {
	t.Helper()
	b, err := exec.Command("ipset", "list", "istio-inpod-probes-v4").CombinedOutput()
	if err != nil {
		t.Fatalf("ipset list: %v: %s", err, b)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == ip.String() {
			return true
		}
	}
	return false
}

// probeSource connects from the node (as kubelet probes do) to a listener
// in the pod and returns the source address the pod saw; an error when the
// pod's own listener got nothing (the connection was captured to ztunnel:
// no probe SNAT).
func probeSource(ctx context.Context, p *e2eenv.Pod) (netip.Addr, error) {
	l, err := p.Listen("tcp4", ":9099")
	if err != nil {
		return netip.Addr{}, err
	}
	defer l.Close()
	got := make(chan netip.Addr, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		got <- netip.MustParseAddrPort(c.RemoteAddr().String()).Addr().Unmap()
		c.Close()
	}()
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "tcp", netip.AddrPortFrom(p.IP(), 9099).String())
	if err != nil {
		return netip.Addr{}, fmt.Errorf("probe-like dial to pod %s: %w", p.Name, err)
	}
	defer c.Close()
	select {
	case a := <-got:
		return a, nil
	case <-time.After(2 * time.Second):
		return netip.Addr{}, fmt.Errorf("pod %s's listener got no probe-like connection (captured to ztunnel instead)", p.Name)
	}
}

// TestHostSideAfterRestartAndDrift (Must show 5): a pod deleted while the
// agent was down loses its probe-set entry at the restart; a probe entry
// deleted by hand comes back (both counted as probe_set repairs); a host rule
// deleted by hand comes back; a node with an earlier terminal POSTROUTING
// rule still SNATs probes.
func TestHostSideAfterRestartAndDrift(t *testing.T) {
	s := newScenario(t, "hostside", within(5*time.Minute), agentEnv(xtablesBackend, "AMBIENTD_VERIFY_INTERVAL=1s"))
	ctx, nsName, a := s.ctx, s.ns, s.agent
	gone := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "gone"})
	stays := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "stays"})
	waitAnnotation(t, ctx, gone, "enabled")
	waitAnnotation(t, ctx, stays, "enabled")
	if !probeSetHas(t, gone.IP()) {
		t.Fatalf("probe set lacks enrolled pod %s (%s)", gone.Name, gone.IP())
	}

	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := testEnv.DeletePod(ctx, gone); err != nil {
		t.Fatalf("delete pod while the agent is down: %v", err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	waitCNIServing(t, ctx)
	if probeSetHas(t, gone.IP()) {
		t.Errorf("probe set still holds %s of pod %s deleted while the agent was down", gone.IP(), gone.Name)
	}
	if !probeSetHas(t, stays.IP()) {
		t.Errorf("probe set lost live pod %s (%s)", stays.Name, stays.IP())
	}
	if n := metricValue(t, ctx, a, "ambientd_repairs_total", `what="probe_set"`); n < 1 {
		t.Errorf("repairs_total{what=probe_set} = %v after the restart's prune removed an entry, want >= 1", n)
	}

	// A probe entry deleted by hand is put back by the drift pass, counted.
	before := metricValue(t, ctx, a, "ambientd_repairs_total", `what="probe_set"`)
	if b, err := exec.Command("ipset", "del", iptables.ProbeSetV4, stays.IP().String()).CombinedOutput(); err != nil {
		t.Fatalf("delete probe entry by hand: %v: %s", err, b)
	}
	testutil.Until(t, ctx, "the probe entry put back", func() bool { return probeSetHas(t, stays.IP()) })
	testutil.Until(t, ctx, "the probe-set repair counted", func() bool {
		return metricValue(t, ctx, a, "ambientd_repairs_total", `what="probe_set"`) >= before+1
	})

	// A host rule deleted by hand comes back (drift pass).
	want := natPostrouting(t)
	for _, tool := range []string{"iptables-legacy", "iptables-nft"} {
		if strings.Contains(want, tool+": -A POSTROUTING -j ISTIO_POSTRT") {
			if b, err := exec.Command(tool, "-w", "-t", "nat", "-D", "POSTROUTING", "-j", "ISTIO_POSTRT").CombinedOutput(); err != nil {
				t.Fatalf("delete host jump by hand: %v: %s", err, b)
			}
		}
	}
	if natPostrouting(t) == want {
		t.Fatalf("no ISTIO_POSTRT jump found to delete in:\n%s", want)
	}
	testutil.Until(t, ctx, "the host jump re-asserted", func() bool { return natPostrouting(t) == want })

}

// TestProbeSNATBeforeEarlierTerminalRule (Must show 5, last part): a node
// where another tool inserted a terminal rule at the top of nat POSTROUTING
// still SNATs probes once the agent (re)asserts its host rules: its jump
// must come first.
func TestProbeSNATBeforeEarlierTerminalRule(t *testing.T) {
	s := newScenario(t, "terminal", within(3*time.Minute), agentEnv(xtablesBackend, "AMBIENTD_VERIFY_INTERVAL=1s"))
	ctx, nsName, a := s.ctx, s.ns, s.agent
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "probed"})
	waitAnnotation(t, ctx, p, "enabled")
	if src, err := probeSource(ctx, p); err != nil || src != iptables.ProbeSNATv4 {
		t.Fatalf("before: probe source %v, %v; want %v", src, err, iptables.ProbeSNATv4)
	}
	for _, tool := range []string{"iptables-legacy", "iptables-nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			continue
		}
		if b, err := exec.Command(tool, "-w", "-t", "nat", "-I", "POSTROUTING", "1", "-p", "tcp", "-j", "ACCEPT").CombinedOutput(); err != nil {
			t.Fatalf("insert terminal rule: %v: %s", err, b)
		}
		t.Cleanup(func() { exec.Command(tool, "-w", "-t", "nat", "-D", "POSTROUTING", "-p", "tcp", "-j", "ACCEPT").Run() })
	}
	// Across a restart too (the node as another tool left it).
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	waitCNIServing(t, ctx)
	var last error
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last probe attempt: %v", last)
		}
	})
	testutil.Until(t, ctx, "probe SNAT despite an earlier terminal POSTROUTING rule", func() bool {
		src, err := probeSource(ctx, p)
		if err == nil && src != iptables.ProbeSNATv4 {
			err = fmt.Errorf("probe source %s, want %s", src, iptables.ProbeSNATv4)
		}
		last = err
		return err == nil
	})
}

// TestRestartNetnsNotFoundThenFound (Must show 6): the agent restarts while
// an `enabled` pod's netns cannot be found (no sandbox process, no state
// file): the pod is not reported enabled meanwhile; once findable, a new
// ztunnel gets an Add for it.
func TestRestartNetnsNotFoundThenFound(t *testing.T) {
	s := newScenario(t, "notfound", within(5*time.Minute), withoutZtunnel(), withoutAgent())
	ctx, nsName := s.ctx, s.ns
	old, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: "ztunnel-nf-old"})
	if err != nil {
		t.Fatal(err)
	}
	old.LogOnFailure(t)
	a := startAgentEnv(t, ctx, "AMBIENTD_RETRY_MAX_DELAY=2s")
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "hidden"})
	waitAnnotation(t, ctx, p, "enabled")

	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := old.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if err := testEnv.StopSandbox(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(testEnv.AgentRunDir, "pods.json")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	em := startEmulator(t, ctx, "ztunnel-nf-new")
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	waitCNIServing(t, ctx)
	waitAnnotation(t, ctx, p, "pending")
	if _, ok := emuState(t, ctx, em).Workload(p.UID); ok {
		// A Keep is fine; an Add without the netns is impossible.
		for _, r := range emuState(t, ctx, em).Requests {
			if r.UID == p.UID && r.Op == "add" {
				t.Fatalf("new ztunnel got an Add while the netns was not findable: %+v", r)
			}
		}
	}

	if err := testEnv.RestartSandbox(ctx, p); err != nil {
		t.Fatal(err)
	}
	st := waitEmu(t, ctx, em, "an Add for the pod once its netns is findable", func(s ztunnelemu.State) bool {
		return countOps(s, "add", p.UID) > 0
	})
	w, _ := st.Workload(p.UID)
	if want := netnsInode(t, p); w.NetnsInode != want {
		t.Errorf("Add carried netns inode %d, want %d", w.NetnsInode, want)
	}
	waitAnnotation(t, ctx, p, "enabled")
	requireCaptured(t, ctx, em, p, outsideAddr())
}

// TestRestartLoad measures, for the note, a restart with 50 enrolled pods:
// from the new agent process's start to the emulator acking its snapshot,
// the rebuild's verification of every pod's rules included. Intact pods must
// cost no rule write.
func TestRestartLoad(t *testing.T) {
	const pods, parallel = 50, 4
	s := newScenario(t, "rload", within(8*time.Minute))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	sem := make(chan struct{}, parallel)
	errs := make(chan error, pods)
	for i := range pods {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: fmt.Sprintf("r-%02d", i)})
			if err == nil {
				t.Cleanup(func() {
					cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					_ = testEnv.DeletePod(cctx, p)
				})
				_, err = testEnv.WaitForPodAnnotation(ctx, p.Namespace, p.Name, annRedirect, "enabled")
			}
			errs <- err
		}()
	}
	for range pods {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	connsBefore := len(emuState(t, ctx, em).Connections)
	start := time.Now()
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	st := waitEmu(t, ctx, em, "snapshot of the restarted agent", func(s ztunnelemu.State) bool {
		return len(s.Connections) > connsBefore && s.Connections[len(s.Connections)-1].SnapshotSent
	})
	took := time.Since(start)
	c := st.Connections[len(st.Connections)-1]
	adds := 0
	for _, it := range c.Snapshot {
		if it.Op == "add" {
			adds++
		}
	}
	if adds != pods {
		t.Errorf("snapshot after restart has %d Adds, want %d", adds, pods)
	}
	if n := metricValue(t, ctx, a, "ambientd_pod_rule_writes_total", ""); n != 0 {
		t.Errorf("restart wrote rules %v times for %d intact pods, want 0", n, pods)
	}
	t.Logf("restart with %d enrolled pods: process start → snapshot acked %v (rules of every pod verified, %v writes)",
		pods, took.Round(time.Millisecond), metricValue(t, ctx, a, "ambientd_pod_rule_writes_total", ""))
}

// TestRestartFindsNetnsFromStateFile: a runtime that keeps no process in the
// sandbox netns (here: the sandbox process is gone) — the restarted agent
// finds the pod's netns through the state file its CNI ADD wrote, so the
// first snapshot carries an Add with that netns and the pod stays enabled.
func TestRestartFindsNetnsFromStateFile(t *testing.T) {
	s := newScenario(t, "statefile")
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "noproc"})
	waitAnnotation(t, ctx, p, "enabled")
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := testEnv.StopSandbox(p); err != nil {
		t.Fatal(err)
	}
	st, c := startAndAwaitSnapshot(t, ctx, a, em)
	if got, want := addInodes(st, c)[p.UID], netnsInode(t, p); got != want {
		t.Fatalf("first snapshot after restart: Add netns inode %d for the pod, want %d (Keep or missing: state file not used)", got, want)
	}
	if v, _ := annotationOf(t, ctx, p); v != "enabled" {
		t.Errorf("annotation %q, want enabled", v)
	}
	requireCaptured(t, ctx, em, p, outsideAddr())
}

// TestIPv6OffRefusesDualStackPod: with --ipv6=false a dual-stack pod is not
// run with its IPv6 uncaptured: its CNI ADD fails with an error naming the
// setting, and it is never annotated.
func TestIPv6OffRefusesDualStackPod(t *testing.T) {
	s := newScenario(t, "v6off", within(3*time.Minute), withoutZtunnel(), withoutAgent())
	ctx, nsName := s.ctx, s.ns
	chain, err := testEnv.Chain.DualStack(netip.MustParsePrefix("fd00:88::/64"), "31-dual.conflist")
	if err != nil {
		t.Fatal(err)
	}
	startEmulator(t, ctx, "ztunnel-v6off")
	startAgentEnv(t, ctx, "AMBIENTD_IPV6=false")
	p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: "dual", Chain: chain})
	if err == nil {
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_ = testEnv.DeletePod(cctx, p)
		})
		v, _ := annotationOf(t, ctx, p)
		t.Fatalf("dual-stack pod started with IPv6 capture off (annotation %q)", v)
	}
	if !strings.Contains(err.Error(), "--ipv6=false") {
		t.Errorf("CNI ADD error does not name the setting: %v", err)
	}
}
