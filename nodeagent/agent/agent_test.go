package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

func TestCNIAddEnrolls(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.zt.connect()
	out, err := h.cni.HandleAdd(t.Context(), h.event(p))
	if err != nil || out != Enrolled {
		t.Fatalf("HandleAdd = %v, %v; want Enrolled", out, err)
	}
	if got := h.state("uid-a"); got != "enabled" {
		t.Errorf("registry state %s, want enabled", got)
	}
	h.zt.mu.Lock()
	w := h.zt.adds[0]
	h.zt.mu.Unlock()
	if want := (ztunnel.Workload{UID: "uid-a", Name: "a", Namespace: "app", ServiceAccount: "sa-a"}); w != want {
		t.Errorf("AddWorkload %+v, want %+v", w, want)
	}
	if _, _, probes := h.rules.counts(); probes != 1 {
		t.Errorf("probe set has %d pods, want 1", probes)
	}
	h.waitFor("annotation enabled", func() bool { v, _ := h.annotation("app", "a"); return v == "enabled" })
}

func TestCNIAddNotInMesh(t *testing.T) {
	plain := pod("plain", "a", "uid-1", nil)
	sys := pod("kube-system", "b", "uid-2", map[string]string{})
	sys.Labels = map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
	h := newHarness(t, withObjects(namespace("plain", false), namespace("kube-system", true), plain, sys))
	h.zt.connect()
	for _, p := range []*corev1.Pod{plain, sys} {
		out, err := h.cni.HandleAdd(t.Context(), h.event(p))
		if err != nil || out != NotInMesh {
			t.Errorf("%s: HandleAdd = %v, %v; want NotInMesh", p.Name, out, err)
		}
	}
	if applied, _, _ := h.rules.counts(); applied != 0 || h.reg.Len() != 0 {
		t.Errorf("rules applied %d times, registry %d; want nothing", applied, h.reg.Len())
	}
}

func TestPendingBecomesEnabledOnSnapshotAck(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	// A backoff far longer than the test: only the snapshot ack can retry.
	slow := func(c *Config) { c.RetryBaseDelay, c.RetryMaxDelay = time.Hour, time.Hour }
	h := newHarness(t, withConfig(slow), withObjects(namespace("app", true), p))
	out, err := h.cni.HandleAdd(t.Context(), h.event(p))
	if err != nil || out != Pending {
		t.Fatalf("HandleAdd = %v, %v; want Pending", out, err)
	}
	if applied, _, _ := h.rules.counts(); applied != 1 {
		t.Errorf("rules applied %d times, want 1 (a pending pod has its rules)", applied)
	}
	h.waitFor("annotation pending", func() bool { v, _ := h.annotation("app", "a"); return v == "pending" })
	start := time.Now()
	h.zt.connect()
	h.waitFor("pod enabled", func() bool { return h.state("uid-a") == "enabled" })
	t.Logf("pending → enabled %v after ztunnel connected", time.Since(start))
	h.waitFor("annotation enabled", func() bool { v, _ := h.annotation("app", "a"); return v == "enabled" })
}

func TestFailPendingRollsBack(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.agent.cfg.FailPending = true
	if _, err := h.cni.HandleAdd(t.Context(), h.event(p)); err == nil {
		t.Fatal("HandleAdd with no ztunnel and FailPending: no error")
	}
	if _, deleted, _ := h.rules.counts(); deleted != 1 || h.reg.Len() != 0 {
		t.Errorf("rules deleted %d times, registry %d; want rolled back", deleted, h.reg.Len())
	}
}

func TestNackLeavesOnlyThatPodPending(t *testing.T) {
	a, b := pod("app", "a", "uid-a", nil), pod("app", "b", "uid-b", nil)
	h := newHarness(t, withObjects(namespace("app", true), a, b))
	h.zt.connect()
	h.zt.setNack("uid-a", "netns broken")
	if out, err := h.cni.HandleAdd(t.Context(), h.event(a)); err != nil || out != Pending {
		t.Fatalf("a: HandleAdd = %v, %v; want Pending", out, err)
	}
	if out, err := h.cni.HandleAdd(t.Context(), h.event(b)); err != nil || out != Enrolled {
		t.Fatalf("b: HandleAdd = %v, %v; want Enrolled", out, err)
	}
	// The backoff retries a while it is nacked: a second Add of a, and a
	// still pending (b's success says nothing about a).
	h.waitFor("a retried", func() bool { return h.zt.tried("uid-a") >= 2 })
	if got := h.state("uid-a"); got != "pending" {
		t.Errorf("a state %s while nacked, want pending", got)
	}
	// ...and it is enabled as soon as ztunnel accepts it.
	h.zt.setNack("uid-a", "")
	h.waitFor("a enabled after nack cleared", func() bool { return h.state("uid-a") == "enabled" })
	if got := h.state("uid-b"); got != "enabled" {
		t.Errorf("b state %s, want enabled", got)
	}
}

// Bad CNI input gets a clear error, in bounded time, leaking nothing: an
// unknown pod; a pod name no pod can have and netns paths that are not
// network namespaces (a missing path, a regular file, a FIFO whose open
// would block, the node's own netns), all refused at once, before the
// lookup; an invalid interface annotation (refused); rules that fail.
func TestCNIAddBadInput(t *testing.T) {
	badTap := pod("app", "vm", "uid-vm", map[string]string{podmeta.AnnotationRerouteVirtualInterfaces: "tap0,tap 1"})
	ok := pod("app", "ok", "uid-ok", nil)
	h := newHarness(t, withConfig(func(c *Config) { c.PodLookupTimeout = 10 * time.Second }), withObjects(namespace("app", true), badTap, ok))
	h.zt.connect()
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	fdsBefore := testutil.CountFDs(t)

	unknown := h.event(pod("app", "ghost", "uid-ghost", nil))
	h.agent.cfg.PodLookupTimeout = 500 * time.Millisecond
	start := time.Now()
	if _, err := h.cni.HandleAdd(t.Context(), unknown); !errors.Is(err, ErrPodUnknown) {
		t.Errorf("unknown pod: %v, want ErrPodUnknown", err)
	} else {
		t.Logf("unknown pod after %v: %v", time.Since(start), err)
	}
	h.agent.cfg.PodLookupTimeout = 10 * time.Second
	dots := h.event(ok)
	dots.Name = "../../etc"
	fifoEv, file, missing, host := h.event(ok), h.event(ok), h.event(ok), h.event(ok)
	fifoEv.NetnsPath, file.NetnsPath, missing.NetnsPath, host.NetnsPath = fifo, "/etc/hostname", "/var/run/netns/does-not-exist", "/proc/self/ns/net"
	for _, c := range []struct {
		name string
		ev   PodEvent
		want error
		says string
	}{
		{"impossible pod name", dots, ErrInvalidPod, `pod name "../../etc"`},
		{"a FIFO", fifoEv, ErrNetnsUnusable, fifo},
		{"a regular file", file, ErrNetnsUnusable, "/etc/hostname"},
		{"a missing path", missing, ErrNetnsUnusable, "does-not-exist"},
		{"the node's own netns", host, ErrNetnsUnusable, "the node's own network namespace"},
	} {
		start := time.Now()
		done := make(chan error, 1)
		go func() { _, err := h.cni.HandleAdd(t.Context(), c.ev); done <- err }()
		select {
		case err := <-done:
			if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
				t.Errorf("%s: %v, want %v naming %q", c.name, err, c.want, c.says)
			}
			if took := time.Since(start); took > time.Second {
				t.Errorf("%s: refused after %v, want at once (the lookup waits up to 10s)", c.name, took)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: HandleAdd blocked (opened the path before checking it?)", c.name)
		}
	}
	if _, err := h.cni.HandleAdd(t.Context(), h.event(badTap)); !errors.Is(err, ErrInvalidPod) || !strings.Contains(err.Error(), `"tap 1" is not an interface name`) {
		t.Errorf("invalid reroute-virtual-interfaces: %v, want ErrInvalidPod naming the interface", err)
	}
	h.waitFor("InvalidAnnotation Event", func() bool { return h.hasEvent("app", EventInvalidAnnotation, "not enrolled") })
	h.rules.mu.Lock()
	h.rules.applyErr = errors.New("iptables-restore: boom")
	h.rules.mu.Unlock()
	if _, err := h.cni.HandleAdd(t.Context(), h.event(ok)); err == nil {
		t.Error("rule failure: no error")
	}
	if applied, deleted, probes := h.rules.counts(); applied != 0 || deleted != 1 || probes != 0 || h.reg.Len() != 0 {
		t.Errorf("leaked: applied=%d deleted=%d probes=%d registry=%d", applied, deleted, probes, h.reg.Len())
	}
	if h.zt.added("uid-ok") != 0 {
		t.Error("pod with failed rules reached ztunnel")
	}
	if after := testutil.CountFDs(t); after > fdsBefore {
		t.Errorf("open fds %d → %d: a netns handle leaked", fdsBefore, after)
	}
	for reason, want := range map[string]float64{"pod_unknown": 1, "invalid_pod": 1, "bad_annotation": 1, "netns": 3, "host_netns": 1, "rules": 1} {
		var m dto.Metric
		if err := h.agent.metrics.failures.WithLabelValues(reason).Write(&m); err != nil {
			t.Fatal(err)
		}
		if v := m.GetCounter().GetValue(); v != want {
			t.Errorf("failures{reason=%q} = %v, want %v", reason, v, want)
		}
	}
}

// Booleans are parsed like Istio's (strconv.ParseBool): "True" and "1"
// enroll; an invalid boolean is ignored (the node's default) with a Warning
// Event, and the pod enrolls.
func TestAnnotationsParsedLikeIstio(t *testing.T) {
	capital := pod("app", "capital", "uid-c", map[string]string{podmeta.AnnotationDNSCapture: "False", podmeta.AnnotationBypassInbound: "1"})
	maybe := pod("app", "maybe", "uid-m", map[string]string{podmeta.AnnotationDNSCapture: "maybe"})
	h := newHarness(t, withConfig(func(c *Config) { c.DNSCapture = true }), withObjects(namespace("app", true), capital, maybe))
	h.zt.connect()
	for _, p := range []*corev1.Pod{capital, maybe} {
		if out, err := h.cni.HandleAdd(t.Context(), h.event(p)); err != nil || out != Enrolled {
			t.Fatalf("%s: HandleAdd = %v, %v; want Enrolled", p.Name, out, err)
		}
	}
	if e, _ := h.reg.Get("uid-c"); e.Options != (iptables.PodOptions{BypassInbound: true}) {
		t.Errorf("False/1 pod enrolled with %+v", e.Options)
	}
	if e, _ := h.reg.Get("uid-m"); e.Options != (iptables.PodOptions{DNSCapture: true}) {
		t.Errorf("maybe pod enrolled with %+v, want the node's default", e.Options)
	}
	h.waitFor("InvalidAnnotation Event", func() bool {
		return h.hasEvent("app", EventInvalidAnnotation, `annotation ambient.istio.io/dns-capture has invalid value "maybe"`)
	})
}

func TestNamespaceUnlabelRemovesPod(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	h.setNamespace("app", false)
	h.waitFor("pod removed", func() bool { return h.state("uid-a") == "absent" })
	if !h.zt.deleted("uid-a") {
		t.Error("DelWorkload not sent")
	}
	if _, deleted, probes := h.rules.counts(); deleted != 1 || probes != 0 {
		t.Errorf("rules deleted %d times, probes %d; want 1, 0", deleted, probes)
	}
	h.waitFor("annotation removed", func() bool { _, ok := h.annotation("app", "a"); return !ok })
}

func TestDeletedPodIsForgotten(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.zt.connect()
	if _, err := h.cni.HandleAdd(t.Context(), h.event(p)); err != nil {
		t.Fatal(err)
	}
	if err := h.client.CoreV1().Pods("app").Delete(t.Context(), "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("pod forgotten", func() bool { return h.state("uid-a") == "absent" })
	if !h.zt.deleted("uid-a") {
		t.Error("DelWorkload not sent")
	}
	if snap := h.agent.Snapshot(); len(snap) != 0 {
		t.Errorf("snapshot after delete: %+v", snap)
	}
}

func TestTerminalPodIsRemoved(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.zt.connect()
	if _, err := h.cni.HandleAdd(t.Context(), h.event(p)); err != nil {
		t.Fatal(err)
	}
	cur, err := h.client.CoreV1().Pods("app").Get(t.Context(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Status.Phase = corev1.PodSucceeded
	if _, err := h.client.CoreV1().Pods("app").UpdateStatus(t.Context(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("terminal pod removed", func() bool { return h.state("uid-a") == "absent" })
	if !h.zt.deleted("uid-a") {
		t.Error("DelWorkload not sent for terminal pod")
	}
	if _, _, probes := h.rules.counts(); probes != 0 {
		t.Errorf("probe entries left: %d", probes)
	}
}

func TestRestartRebuildsRegistry(t *testing.T) {
	enabled := runningPod(pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "10.1.0.5")
	pending := runningPod(pod("app", "b", "uid-b", map[string]string{podmeta.AnnotationRedirection: "pending"}), "10.1.0.6")
	plain := runningPod(pod("app", "c", "uid-c", nil), "10.1.0.7")
	done := runningPod(pod("app", "d", "uid-d", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "10.1.0.8")
	done.Status.Phase = corev1.PodSucceeded
	// The host proc is empty, so no netns is found: the restored pods are
	// offered as Keep. The hour-long backoff keeps the pending pod's failed
	// netns lookup from changing anything while the test looks.
	h := newHarness(t, withConfig(func(c *Config) { c.RetryBaseDelay, c.RetryMaxDelay = time.Hour, time.Hour }), withObjects(namespace("app", true), enabled, pending, plain, done))
	snap := h.agent.Snapshot()
	var got []string
	for _, e := range snap {
		if e.Netns != nil {
			t.Errorf("%s: netns found in an empty host proc", e.Workload.UID)
		}
		got = append(got, e.Workload.UID+"/"+e.Workload.ServiceAccount)
	}
	// Every live in-mesh pod is kept (ztunnel may serve it), the
	// unannotated one too; none is enabled while its netns is unknown.
	if want := []string{"uid-a/sa-a", "uid-b/sa-b", "uid-c/sa-c"}; !slices.Equal(got, want) {
		t.Errorf("snapshot after rebuild %v, want %v (Keep entries)", got, want)
	}
	for _, uid := range []string{"uid-a", "uid-b", "uid-c"} {
		if st := h.state(uid); st != "uncaptured" {
			t.Errorf("%s: state %s, want uncaptured (netns not found)", uid, st)
		}
	}
	h.waitFor("enabled pod whose netns is not found shows pending", func() bool { v, _ := h.annotation("app", "a"); return v == "pending" })
	if applied, _, _ := h.rules.counts(); applied != 0 {
		t.Errorf("rebuild applied rules %d times, want 0 (no netns to apply them in)", applied)
	}
}

// TestRestartRestoresUnannotatedPods: the agent died after ztunnel took a pod
// but before its annotation landed. The restarted agent's first snapshot must
// still hold the pod (with its netns, found in /proc), and the reconcile must
// verify its rules and enable it without ever sending a Del. An in-mesh pod
// without annotation whose netns is not found is kept (Keep); pods outside
// the mesh and terminal pods are not restored.
func TestRestartRestoresUnannotatedPods(t *testing.T) {
	// The fake host proc: one "sandbox process" per pod, whose cgroup names
	// the pod uid and whose netns is this test's, which holds 127.0.0.1.
	hostProc := t.TempDir()
	podNS := testutil.NewNetNS(t)
	sandbox := func(pid int, uid string) { fakeSandbox(t, hostProc, pid, uid, podNS.NS.Path()) }
	lost := runningPod(pod("app", "lost", "uid-lost", nil), "127.0.0.1")
	enabled := runningPod(pod("app", "on", "uid-on", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "127.0.0.1")
	nowhere := runningPod(pod("app", "nowhere", "uid-nowhere", nil), "10.1.0.9")
	outside := runningPod(pod("plain", "out", "uid-out", nil), "127.0.0.1")
	optOut := runningPod(pod("app", "optout", "uid-optout", nil), "127.0.0.1")
	optOut.Labels = map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeNone}
	done := runningPod(pod("app", "done", "uid-done", nil), "127.0.0.1")
	done.Status.Phase = corev1.PodSucceeded
	for i, uid := range []string{"uid-lost", "uid-on", "uid-out", "uid-optout", "uid-done"} {
		sandbox(100+i, uid)
	}

	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), namespace("plain", false), lost, enabled, nowhere, outside, optOut, done))
	first := h.firstSnapshot()
	got := map[string]bool{} // uid → netns present
	for _, e := range first {
		got[e.Workload.UID] = e.Netns != nil
	}
	if want := map[string]bool{"uid-lost": true, "uid-on": true, "uid-nowhere": false}; !maps.Equal(got, want) {
		t.Errorf("first snapshot after restart (uid → has netns) %v, want %v", got, want)
	}

	// ztunnel connects and acks: the restored pod is re-applied and enabled.
	h.zt.connect()
	h.waitFor("restored pod enabled", func() bool {
		v, _ := h.annotation("app", "lost")
		return v == "enabled" && h.state("uid-lost") == "enabled"
	})
	if e, _ := h.reg.Get("uid-lost"); e.Phase == registry.Unverified {
		t.Error("restored pod still has unverified rules after being enabled")
	}
	if applied, _, _ := h.rules.counts(); applied != 0 {
		t.Errorf("rules applied %d times, want 0: intact rules are verified, not rewritten", applied)
	}
	h.rules.mu.Lock()
	verified := h.rules.verified
	h.rules.mu.Unlock()
	if verified < 2 {
		t.Errorf("rules verified %d times, want both restored pods' rules read back", verified)
	}
	if h.zt.added("uid-lost") < 1 {
		t.Error("no fresh Add for the restored pod")
	}
	for _, uid := range []string{"uid-lost", "uid-on"} {
		if h.zt.deleted(uid) {
			t.Errorf("Del sent for live pod %s", uid)
		}
	}
	for _, uid := range []string{"uid-out", "uid-optout", "uid-done"} {
		if st := h.state(uid); st != "absent" {
			t.Errorf("%s: registry state %s, want absent", uid, st)
		}
	}
	if st := h.state("uid-on"); st != "enabled" {
		t.Errorf("annotated pod: registry state %s, want enabled", st)
	}
}

func TestHealth(t *testing.T) {
	h := newHarness(t)
	if err := h.agent.Live(); err != nil {
		t.Errorf("Live: %v", err)
	}
	// Readiness (nodeready.Compute) with the agent's inputs, as the daemon
	// computes it.
	ready := func() error {
		return nodeready.Compute(nodeready.Inputs{
			PluginInstalled: func() error { return nil },
			AgentStarted:    h.agent.Started,
			Ztunnel: func() nodeready.ZtunnelState {
				st := h.zt.Status()
				return nodeready.ZtunnelState{Connected: st.Connections > 0, SnapshotAcked: st.SnapshotAcked}
			},
			CNIServing: func() bool { return true },
		}).Err()
	}
	if !h.agent.Started() {
		t.Error("Started after Run's rebuild: false")
	}
	if err := ready(); err == nil {
		t.Error("Ready with no ztunnel: nil")
	}
	h.zt.connect()
	if err := ready(); err != nil {
		t.Errorf("Ready: %v", err)
	}
	// Workers that stop while the agent is meant to run make it not live
	// (kubelet restarts it).
	h.agent.queue.ShutDown()
	h.waitFor("Live fails once the workers are gone", func() bool { return h.agent.Live() != nil })
}

// BenchmarkHandleAdd measures the agent's own cost of a CNI ADD for an
// in-mesh pod (cache lookup, policy, netns open, registry, bookkeeping), with
// fake rules and ztunnel: the lower bound under the real iptables and ZDS costs.
func BenchmarkHandleAdd(b *testing.B) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(b, withObjects(namespace("app", true), p))
	h.zt.connect()
	ev := h.event(p)
	ctx := b.Context()
	b.ResetTimer()
	for b.Loop() {
		if out, err := h.cni.HandleAdd(ctx, ev); err != nil || out != Enrolled {
			b.Fatalf("HandleAdd = %v, %v", out, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/add")
}

// TestRemovalKeepsPodWhoseRulesCannotBeDeleted: a pod restored after a
// restart without its netns (the /proc scan missed it) leaves the mesh. Its
// rules cannot be deleted, so its traffic is still captured: ztunnel must
// keep serving it (no Del), and it stays registered and annotated, retried.
func TestRemovalKeepsPodWhoseRulesCannotBeDeleted(t *testing.T) {
	p := runningPod(pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "10.1.0.5")
	h := newHarness(t, withObjects(namespace("app", true), p)) // empty host proc: no netns is ever found
	h.zt.connect()
	if h.state("uid-a") != "uncaptured" {
		t.Fatalf("restored pod state %s, want uncaptured (netns not found)", h.state("uid-a"))
	}
	h.setNamespace("app", false)
	h.waitFor("removal tried twice", func() bool { return h.failures("removal") >= 2 })
	if h.zt.deleted("uid-a") {
		t.Error("Del sent for a pod whose rules are still in place")
	}
	if st := h.state("uid-a"); st != "uncaptured" {
		t.Errorf("registry state %s, want uncaptured (still registered, retried)", st)
	}
}

// TestFailPendingRollbackTellsZtunnel: with --fail-pending, a pod whose ack
// never came is rolled back everywhere, ztunnel included (it may have taken
// the pod), so ztunnel does not keep the torn-down sandbox's netns.
func TestFailPendingRollbackTellsZtunnel(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.agent.cfg.FailPending = true
	h.zt.connect()
	h.zt.setNack("uid-a", "ack lost")
	if _, err := h.cni.HandleAdd(t.Context(), h.event(p)); err == nil {
		t.Fatal("HandleAdd with a nack and FailPending: no error")
	}
	if !h.zt.deleted("uid-a") {
		t.Error("rollback sent no Del to ztunnel")
	}
	if _, deleted, probes := h.rules.counts(); deleted != 1 || probes != 0 || h.reg.Len() != 0 {
		t.Errorf("rules deleted %d, probe entries %d, registry %d; want 1, 0, 0", deleted, probes, h.reg.Len())
	}
}

// TestSnapshotRefusalMakesPodPending: a new ztunnel refuses an enabled pod in
// its snapshot. The pod is not carried, so it must go back to pending and be
// sent again when the snapshot is acked; once accepted it is enabled again.
func TestSnapshotRefusalMakesPodPending(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.enrollConnected(p)

	// The new ztunnel refuses the pod in its snapshot and keeps refusing it.
	h.zt.setNack("uid-a", "netns gone")
	h.agent.SnapshotRefused("uid-a", errors.New("netns gone"))
	h.waitFor("pod pending after the refusal", func() bool { return h.state("uid-a") == "pending" })
	h.zt.connect() // the snapshot ack
	h.waitFor("pod sent again, refused, and marked pending", func() bool {
		v, _ := h.annotation("app", "a")
		return h.failures("ztunnel_nack") >= 1 && v == "pending"
	})
	addsBefore := h.zt.added("uid-a")

	h.zt.setNack("uid-a", "")
	h.zt.connect()
	h.waitFor("pod enabled again", func() bool {
		v, _ := h.annotation("app", "a")
		return h.state("uid-a") == "enabled" && v == "enabled" && h.zt.added("uid-a") > addsBefore
	})
}

func TestCNIDelWithoutUIDMatchesByNetns(t *testing.T) {
	h := newHarness(t, withRealNetns(), withObjects(namespace("app", true)))
	other := testutil.NewNetNS(t)
	for uid, path := range map[string]string{"uid-old": h.podNetns, "uid-new": other.NS.Path()} {
		f, err := podnetns.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		h.put(registry.Entry{UID: uid, Name: "web-0", Namespace: "app", Netns: f, Phase: registry.Enabled})
	}
	if err := h.cni.HandleDel(t.Context(), PodEvent{Namespace: "app", Name: "web-0", NetnsPath: other.NS.Path()}); err != nil {
		t.Fatal(err)
	}
	if h.state("uid-new") != "absent" || h.state("uid-old") != "enabled" {
		t.Errorf("after DEL of the new pod's netns: new=%s old=%s, want absent, enabled", h.state("uid-new"), h.state("uid-old"))
	}
	// Several candidates and a netns that is gone: nobody is dropped.
	h.put(registry.Entry{UID: "uid-new2", Name: "web-0", Namespace: "app", Phase: registry.Enabled})
	if err := h.cni.HandleDel(t.Context(), PodEvent{Namespace: "app", Name: "web-0", NetnsPath: "/nonexistent"}); err != nil {
		t.Fatal(err)
	}
	if h.state("uid-old") != "enabled" || h.state("uid-new2") != "enabled" {
		t.Error("a DEL without uid for a vanished netns dropped a pod")
	}
}

// A CNI DEL with the pod's uid drops the pod only when it is about the
// sandbox the pod is enrolled with. containerd 1.6 repeats DEL with an empty
// netns when kubelet removes a dead sandbox, which comes while a recreated
// sandbox runs; that one must not drop the live pod.
func TestCNIDelWithUIDOnlyForTheEnrolledSandbox(t *testing.T) {
	current := testutil.NewNetNS(t)
	other := testutil.NewNetNS(t)
	gone := filepath.Join(t.TempDir(), "gone")
	cases := []struct {
		name      string
		enrolled  string // path the enrollment's netns was opened by
		removeIt  bool   // that path disappears before the DEL
		delNetns  string
		wantState string
	}{
		{"DEL of the enrolled netns", current.NS.Path(), false, current.NS.Path(), "absent"},
		{"DEL naming another sandbox's netns", current.NS.Path(), false, other.NS.Path(), "enabled"},
		{"repeated DEL, empty netns, enrolled netns still there", current.NS.Path(), false, "", "enabled"},
		{"repeated DEL, empty netns, enrolled netns gone", gone, true, "", "absent"},
		// A runtime removing an old sandbox, netns first: the live one
		// (still at its path) must stay enrolled.
		{"DEL naming another netns that is gone", current.NS.Path(), false, "/nonexistent/netns", "enabled"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, withRealNetns(), withObjects(namespace("app", true)))
			if c.enrolled == gone {
				if err := os.Symlink(current.NS.Path(), gone); err != nil {
					t.Fatal(err)
				}
			}
			f, err := podnetns.Open(c.enrolled)
			if err != nil {
				t.Fatal(err)
			}
			if c.removeIt {
				if err := os.Remove(c.enrolled); err != nil {
					t.Fatal(err)
				}
			}
			h.put(registry.Entry{UID: "uid-a", Name: "web", Namespace: "app", Netns: f, Phase: registry.Enabled})
			if err := h.cni.HandleDel(t.Context(), PodEvent{Namespace: "app", Name: "web", UID: "uid-a", NetnsPath: c.delNetns}); err != nil {
				t.Fatal(err)
			}
			if got := h.state("uid-a"); got != c.wantState {
				t.Errorf("after DEL with netns %q: pod %s, want %s", c.delNetns, got, c.wantState)
			}
		})
	}
}

// TestUnfinishedReleaseIsFinishedFirst: a removal whose Del failed leaves
// the pod Releasing: its rules are gone, a new ztunnel's snapshot must not
// carry it, and when the pod belongs in the mesh again the release is
// finished and the pod enrolled afresh (rules applied again), never left
// "enabled" without rules.
func TestUnfinishedReleaseIsFinishedFirst(t *testing.T) {
	hostProc := t.TempDir()
	fakeSandbox(t, hostProc, 100, "uid-a", testutil.NewNetNS(t).NS.Path())
	p := runningPod(pod("app", "a", "uid-a", nil), "127.0.0.1")
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), p))
	h.zt.connect()
	h.waitFor("running pod enabled", func() bool { return h.state("uid-a") == "enabled" })
	applied, _, _ := h.rules.counts()

	h.zt.mu.Lock()
	h.zt.delErr = fmt.Errorf("del: %w", ztunnel.ErrConnBroken)
	h.zt.mu.Unlock()
	h.setNamespace("app", false)
	h.waitFor("removal failing at the Del", func() bool { return h.failures("removal") >= 1 })
	if e, ok := h.reg.Get("uid-a"); !ok || e.Phase != registry.Releasing {
		t.Fatalf("after a failed Del: entry %+v registered=%v, want Releasing", e, ok)
	}
	if snap := h.agent.Snapshot(); len(snap) != 0 {
		t.Errorf("snapshot during the release holds %d pods, want none", len(snap))
	}

	// The namespace is labelled again while ztunnel accepts Dels again.
	h.zt.mu.Lock()
	h.zt.delErr = nil
	h.zt.mu.Unlock()
	h.setNamespace("app", true)
	h.waitFor("pod enrolled afresh", func() bool {
		e, ok := h.reg.Get("uid-a")
		now, _, _ := h.rules.counts()
		return ok && e.Phase == registry.Enabled && now > applied
	})
}

// TestLookupIsGentle: a CNI ADD for a pod the informer has not seen waits on
// the informer (a pod that appears there is taken without any GET), then
// falls back to direct GETs whose backoff doubles up to a cap — not a GET
// every few milliseconds. The clock is synctest's, so the schedule is exact
// however busy the machine is.
func TestLookupIsGentle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		gets := map[string][]time.Time{} // pod name → when it was GET
		record := func(a k8stesting.Action) (bool, runtime.Object, error) {
			mu.Lock()
			defer mu.Unlock()
			name := a.(k8stesting.GetAction).GetName()
			gets[name] = append(gets[name], time.Now())
			return false, nil, nil
		}
		getsOf := func(name string) []time.Time {
			mu.Lock()
			defer mu.Unlock()
			return slices.Clone(gets[name])
		}
		const cacheWait, lookupTimeout = time.Second, 2 * time.Second
		h := newHarness(t, withConfig(func(c *Config) { c.PodLookupTimeout, c.CacheWait = lookupTimeout, cacheWait }),
			withObjects(namespace("app", true)), withReactor("get", "pods", record))
		h.zt.connect()

		// Appears in the informer while the ADD waits for it: no GET.
		late := pod("app", "late", "uid-late", nil)
		done := make(chan error, 1)
		go func() {
			_, err := h.cni.HandleAdd(t.Context(), h.event(late))
			done <- err
		}()
		if _, err := h.client.CoreV1().Pods("app").Create(t.Context(), late, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("HandleAdd of a pod that appeared meanwhile: %v", err)
		}
		if n := len(getsOf("late")); n != 0 {
			t.Errorf("%d GETs for a pod the informer delivered within CacheWait, want 0", n)
		}

		// Never appears: the first GET once CacheWait has passed, then each
		// after twice the previous wait (from lookupBackoffBase, capped at
		// lookupBackoffMax), none after PodLookupTimeout.
		start := time.Now()
		_, err := h.cni.HandleAdd(t.Context(), h.event(pod("app", "ghost", "uid-ghost", nil)))
		if !errors.Is(err, ErrPodUnknown) {
			t.Fatalf("HandleAdd of an unknown pod = %v, want ErrPodUnknown", err)
		}
		if took := time.Since(start); took != lookupTimeout {
			t.Errorf("unknown pod refused after %v, want after PodLookupTimeout (%v)", took, lookupTimeout)
		}
		var want, got []time.Duration
		for at, wait := cacheWait, lookupBackoffBase; at < lookupTimeout; at, wait = at+wait, min(2*wait, lookupBackoffMax) {
			want = append(want, at)
		}
		for _, at := range getsOf("ghost") {
			got = append(got, at.Sub(start))
		}
		if !slices.Equal(got, want) {
			t.Errorf("GETs of an unknown pod at %v after the ADD, want %v (after CacheWait, capped exponential backoff)", got, want)
		}
	})
}

// TestCNIAddAbandonedIsNotFinished: an ADD that waits for the pod's lock
// (another operation on the pod is slow) past its caller's deadline fails
// and leaves nothing behind, and does not run once the lock is free.
func TestCNIAddAbandonedIsNotFinished(t *testing.T) {
	p := pod("app", "slow", "uid-slow", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.zt.connect()
	unlock := h.agent.locks.lock("uid-slow") // a slow sync of the same pod
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := h.cni.HandleAdd(ctx, h.event(p)); done <- err }()
	var err error
	select {
	case err = <-done:
	case <-time.After(10 * time.Second):
		unlock() // the old behaviour: the ADD runs once the lock is free
		err = <-done
		t.Errorf("HandleAdd kept waiting for the pod's lock past its deadline")
	}
	unlock()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("HandleAdd = %v; want an error wrapping context.DeadlineExceeded", err)
	}
	if applied, _, _ := h.rules.counts(); applied != 0 {
		t.Errorf("rules applied %d times for an abandoned ADD; want 0", applied)
	}
	if _, ok := h.reg.Get("uid-slow"); ok || h.zt.tried("uid-slow") != 0 {
		t.Errorf("abandoned ADD registered the pod (%v) or told ztunnel (%d tries)", ok, h.zt.tried("uid-slow"))
	}
	if got := h.failures("deadline"); got != 1 {
		t.Errorf("ambientd_failures_total{reason=deadline} = %v, want 1", got)
	}
}

// TestCNIAddsRunInParallel: ADDs of different pods do not wait for each
// other: while one pod's lock is held, another pod enrolls.
func TestCNIAddsRunInParallel(t *testing.T) {
	a, b := pod("app", "a", "uid-a", nil), pod("app", "b", "uid-b", nil)
	h := newHarness(t, withObjects(namespace("app", true), a, b))
	h.zt.connect()
	unlock := h.agent.locks.lock("uid-a")
	defer unlock()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if out, err := h.cni.HandleAdd(ctx, h.event(b)); err != nil || out != Enrolled {
		t.Fatalf("HandleAdd(b) while a is locked = %v, %v; want Enrolled", out, err)
	}
}

// TestRestartDeletesRulesOfStaleUnannotatedPod: the agent stopped while
// enrolling a pod (its netns recorded, rules programmed, no annotation yet)
// and the pod's namespace left the mesh meanwhile. The restarted agent
// deletes that pod's rules and forgets it, without registering it (not in
// ztunnel's snapshot); an out-of-mesh pod the state file does not record is
// not touched.
func TestRestartDeletesRulesOfStaleUnannotatedPod(t *testing.T) {
	runDir := t.TempDir()
	st, err := podnetns.OpenState(filepath.Join(runDir, "pods.json"))
	if err != nil {
		t.Fatal(err)
	}
	h0, err := podnetns.Open(testutil.NewNetNS(t).NS.Path()) // lo holds the pod's IP, 127.0.0.1
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Put("uid-stale", h0, iptables.PodOptions{}); err != nil {
		t.Fatal(err)
	}
	h0.Close()
	stale := runningPod(pod("plain", "stale", "uid-stale", nil), "127.0.0.1")
	other := runningPod(pod("plain", "other", "uid-other", nil), "127.0.0.1")

	h := newHarness(t, withConfig(func(c *Config) { c.RunDir = runDir }), withObjects(namespace("plain", false), stale, other))
	first := h.firstSnapshot()
	if len(first) != 0 {
		t.Errorf("first snapshot %v, want empty (no pod is in the mesh)", first)
	}
	if _, deleted, _ := h.rules.counts(); deleted != 1 {
		t.Errorf("rules deleted %d times, want 1 (the stale pod's)", deleted)
	}
	after, err := podnetns.OpenState(filepath.Join(runDir, "pods.json"))
	if err != nil {
		t.Fatal(err)
	}
	if after.Has("uid-stale") {
		t.Error("stale pod still in the state file after its rules were deleted")
	}
	if h.reg.Len() != 0 {
		t.Errorf("registry holds %d pods, want 0", h.reg.Len())
	}
}
