package agent

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// servingZtunnel is a ztunnel server whose Status the test sets; only
// Status and SubscribeStatus are used by followZtunnel.
type servingZtunnel struct {
	Ztunnel
	mu      sync.Mutex
	serving int
	ch      chan struct{}
}

func (z *servingZtunnel) Status() ztunnel.Status {
	z.mu.Lock()
	defer z.mu.Unlock()
	return ztunnel.Status{Connections: z.serving, SnapshotAcked: z.serving > 0, Serving: z.serving}
}

func (z *servingZtunnel) SubscribeStatus() (<-chan struct{}, func()) { return z.ch, func() {} }

func (z *servingZtunnel) set(serving int) {
	z.mu.Lock()
	z.serving = serving
	z.mu.Unlock()
	select {
	case z.ch <- struct{}{}:
	default:
	}
}

// followed is an agent with only what followZtunnel uses, one enabled pod,
// and the loop running; stop ends it.
type followed struct {
	a    *Agent
	zt   *servingZtunnel
	rec  *record.FakeRecorder
	stop func()
}

func follow(t *testing.T, grace time.Duration, serving int) *followed {
	t.Helper()
	zt := &servingZtunnel{serving: serving, ch: make(chan struct{}, 1)}
	rec := record.NewFakeRecorder(10)
	a := &Agent{
		cfg: Config{NodeName: node, ZtunnelGrace: grace, PodConditionType: podmeta.ConditionEnrolled},
		log: slog.New(slog.DiscardHandler), zt: zt, reg: registry.New(), recorder: rec,
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
	}
	if _, err := a.reg.Update("uid-a", func(e *registry.Entry) { e.Name, e.Namespace, e.Phase = "a", "app", registry.Enabled }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	a.liveLoops.Add(1)
	go func() { a.followZtunnel(ctx, zt.ch); close(done) }()
	return &followed{a: a, zt: zt, rec: rec, stop: func() { cancel(); <-done; a.queue.ShutDown() }}
}

// events drains the Events recorded so far.
func (f *followed) events() []string {
	var out []string
	for {
		select {
		case e := <-f.rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// TestFollowZtunnelOutageAtTheGrace: the last ztunnel leaves; a moment
// before the grace nothing has happened; at the grace the outage is
// declared — the enabled pod queued for its sync, one Warning Event on the
// node counting it. A ztunnel that acks its snapshot ends it with a Normal
// Event; a second outage is a second Warning, not more.
func TestFollowZtunnelOutageAtTheGrace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const grace = 5 * time.Second
		f := follow(t, grace, 1)
		defer f.stop()
		synctest.Wait()
		time.Sleep(time.Minute) // served all along: nothing
		synctest.Wait()
		if f.a.ztunnelOutage() || f.a.queue.Len() != 0 || len(f.events()) != 0 {
			t.Fatalf("outage %v, queue %d while a ztunnel serves", f.a.ztunnelOutage(), f.a.queue.Len())
		}

		f.zt.set(0)
		synctest.Wait()
		time.Sleep(grace - time.Millisecond)
		synctest.Wait()
		if f.a.ztunnelOutage() || f.a.queue.Len() != 0 {
			t.Fatalf("outage declared %v before the grace", grace-time.Millisecond)
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		if !f.a.ztunnelOutage() || f.a.queue.Len() != 1 {
			t.Fatalf("at the grace: outage %v, queue %d; want the outage and the enabled pod queued", f.a.ztunnelOutage(), f.a.queue.Len())
		}
		evs := f.events()
		if len(evs) != 1 || !strings.HasPrefix(evs[0], "Warning "+EventZtunnelUnavailable+" ") || !strings.Contains(evs[0], "1 pods marked not ready") {
			t.Fatalf("node Events %q, want one Warning %s counting 1 pod", evs, EventZtunnelUnavailable)
		}

		f.zt.set(1)
		synctest.Wait()
		if f.a.ztunnelOutage() {
			t.Fatal("outage still declared after a ztunnel acked its snapshot")
		}
		if evs := f.events(); len(evs) != 1 || !strings.HasPrefix(evs[0], "Normal "+EventZtunnelAvailable+" ") {
			t.Fatalf("node Events %q, want one Normal %s", evs, EventZtunnelAvailable)
		}
		f.zt.set(0)
		time.Sleep(10 * grace)
		synctest.Wait()
		if evs := f.events(); len(evs) != 1 || !strings.HasPrefix(evs[0], "Warning "+EventZtunnelUnavailable) {
			t.Fatalf("second outage: node Events %q, want one Warning", evs)
		}
	})
}

// TestFollowZtunnelOverlapIsNoOutage: a rolling upgrade with maxSurge —
// the new ztunnel serves (2), then the old leaves (1) — with the shortest
// grace: never an outage. Neither is a ztunnel that leaves and one that
// serves again within the grace (a container restart).
func TestFollowZtunnelOverlapIsNoOutage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const grace = time.Nanosecond
		f := follow(t, grace, 1)
		defer f.stop()
		for range 3 {
			f.zt.set(2)
			synctest.Wait()
			time.Sleep(time.Second)
			f.zt.set(1)
			synctest.Wait()
			time.Sleep(time.Second)
		}
		if f.a.ztunnelOutage() || f.a.queue.Len() != 0 || len(f.events()) != 0 {
			t.Fatal("outage declared during overlapping upgrades")
		}
	})
	synctest.Test(t, func(t *testing.T) {
		const grace = 5 * time.Second
		f := follow(t, grace, 1)
		defer f.stop()
		f.zt.set(0)
		time.Sleep(grace - time.Second) // a container restart
		f.zt.set(1)
		synctest.Wait()
		time.Sleep(10 * grace)
		synctest.Wait()
		if f.a.ztunnelOutage() || f.a.queue.Len() != 0 || len(f.events()) != 0 {
			t.Fatal("outage declared for a ztunnel back within the grace")
		}
	})
}

// TestFollowZtunnelNeverServed: a (re)started agent gives ztunnel its
// reconnect back-off on top of the grace — ztunnel kept serving while the
// agent was down — then an agent whose node gets no ztunnel declares the
// outage; with grace 0 never.
func TestFollowZtunnelNeverServed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const grace = 2 * time.Second
		f := follow(t, grace, 0)
		defer f.stop()
		time.Sleep(grace + ZtunnelReconnectAllowance - time.Millisecond)
		synctest.Wait()
		if f.a.ztunnelOutage() {
			t.Fatal("outage declared before ztunnel's reconnect allowance after the start")
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		if !f.a.ztunnelOutage() {
			t.Fatal("no outage a grace and the reconnect allowance after the start with no ztunnel")
		}
	})
	synctest.Test(t, func(t *testing.T) {
		// ztunnel reconnects late after the agent's restart (its back-off):
		// no outage; from then on the plain grace counts.
		const grace = 2 * time.Second
		f := follow(t, grace, 0)
		defer f.stop()
		time.Sleep(ZtunnelReconnectAllowance)
		f.zt.set(1)
		synctest.Wait()
		f.zt.set(0)
		time.Sleep(grace)
		synctest.Wait()
		if !f.a.ztunnelOutage() || len(f.events()) != 1 {
			t.Fatal("after a ztunnel served once, the plain grace must count")
		}
	})
	synctest.Test(t, func(t *testing.T) {
		f := follow(t, 0, 0)
		defer f.stop()
		time.Sleep(time.Hour)
		synctest.Wait()
		if f.a.ztunnelOutage() || len(f.events()) != 0 {
			t.Fatal("outage declared with the grace off (0)")
		}
	})
}

// statusPatches records the pods/status patches the fake API received, per
// pod name.
type statusPatches struct {
	mu sync.Mutex
	n  map[string]int
}

func (s *statusPatches) reactor() harnessOption {
	return withReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if pa, ok := a.(k8stesting.PatchAction); ok && pa.GetSubresource() == "status" {
			s.mu.Lock()
			s.n[pa.GetName()]++
			s.mu.Unlock()
		}
		return false, nil, nil
	})
}

func (s *statusPatches) of(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n[name]
}

func (h *harness) conditionIs(namespace, name string, status corev1.ConditionStatus, reason string) bool {
	c := h.condition(namespace, name)
	return c != nil && c.Status == status && c.Reason == reason
}

func (h *harness) notReady(reason string) float64 {
	h.t.Helper()
	mfs, err := h.agent.Metrics().Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "ambientd_pods_not_ready" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if labelIs(m, "reason", reason) {
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}

func labelIs(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// TestZtunnelGoneUnservesEnabledPods: two enabled pods, the ztunnel leaves:
// after the grace both are Unserved — condition False/ZtunnelUnavailable,
// annotation still enabled, counted by ambientd_pods_not_ready — in one
// status write each. A ztunnel that refused one of them in its snapshot
// acks it: the other is True/Enrolled again (one more write), the refused
// one False/ZtunnelRejected.
func TestZtunnelGoneUnservesEnabledPods(t *testing.T) {
	const grace = 300 * time.Millisecond
	patches := &statusPatches{n: map[string]int{}}
	a, b := pod("app", "a", "uid-a", nil), pod("app", "b", "uid-b", nil)
	h := newHarness(t, withConfig(func(c *Config) { c.ZtunnelGrace = grace }), patches.reactor(), withObjects(namespace("app", true), a, b))
	h.enrollConnected(a)
	h.enrollConnected(b)
	h.waitFor("both True/Enrolled", func() bool {
		return h.conditionIs("app", "a", corev1.ConditionTrue, ReasonEnrolled) && h.conditionIs("app", "b", corev1.ConditionTrue, ReasonEnrolled)
	})
	before := map[string]int{"a": patches.of("a"), "b": patches.of("b")}

	left := time.Now()
	h.zt.disconnect()
	h.waitFor("both False/ZtunnelUnavailable", func() bool {
		return h.conditionIs("app", "a", corev1.ConditionFalse, ReasonZtunnelUnavailable) && h.conditionIs("app", "b", corev1.ConditionFalse, ReasonZtunnelUnavailable)
	})
	if took := time.Since(left); took < grace {
		t.Errorf("False %v after the ztunnel left, before the grace %v", took, grace)
	}
	for _, name := range []string{"a", "b"} {
		if v, _ := h.annotation("app", name); v != "enabled" {
			t.Errorf("pod %s annotation %q while unserved, want enabled", name, v)
		}
		if got := patches.of(name) - before[name]; got != 1 {
			t.Errorf("pod %s: %d status writes for the move to unserved, want 1", name, got)
		}
	}
	if st := h.state("uid-a"); st != "unserved" {
		t.Errorf("phase %s, want unserved", st)
	}
	if n := h.notReady(ReasonZtunnelUnavailable); n != 2 {
		t.Errorf("ambientd_pods_not_ready{reason=ZtunnelUnavailable} = %v, want 2", n)
	}

	h.zt.setNack("uid-b", "no room")
	h.agent.SnapshotRefused("uid-b", &ztunnel.NackError{Op: "add", UID: "uid-b", Message: "no room"})
	h.zt.connect()
	h.waitFor("a True/Enrolled, b False/ZtunnelRejected", func() bool {
		return h.conditionIs("app", "a", corev1.ConditionTrue, ReasonEnrolled) && h.conditionIs("app", "b", corev1.ConditionFalse, ReasonZtunnelRejected)
	})
	if got := patches.of("a") - before["a"]; got != 2 {
		t.Errorf("pod a: %d status writes for the outage, want 2 (False, True)", got)
	}
	if v, _ := h.annotation("app", "b"); v != "pending" {
		t.Errorf("refused pod's annotation %q, want pending", v)
	}
	if h.zt.added("uid-a") < 2 {
		t.Errorf("pod a Added %d times: the new ztunnel must have taken its Add", h.zt.added("uid-a"))
	}
}

// TestRestartKeepsUnservedPodsFalse: the agent restarts while its node has
// no ztunnel; a pod that shows enabled with False/ZtunnelUnavailable is
// restored Unserved, so no sync writes True before a ztunnel has it; once
// one connects it is True again.
func TestRestartKeepsUnservedPodsFalse(t *testing.T) {
	hostProc := t.TempDir()
	fakeSandbox(t, hostProc, 100, "uid-a", testutil.NewNetNS(t).NS.Path())
	p := runningPod(pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "127.0.0.1")
	p.Status.Conditions = []corev1.PodCondition{{Type: podmeta.ConditionEnrolled, Status: corev1.ConditionFalse, Reason: ReasonZtunnelUnavailable, Message: "no ztunnel"}}
	patches := &statusPatches{n: map[string]int{}}
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc, c.ZtunnelGrace = hostProc, time.Hour }), patches.reactor(), withObjects(namespace("app", true), p))
	if st := h.state("uid-a"); st != "unserved" {
		t.Fatalf("restored as %s, want unserved", st)
	}
	if n := patches.of("a"); n != 0 {
		t.Errorf("%d status writes before any ztunnel connected, want 0 (the pod shows what it is)", n)
	}
	h.zt.connect()
	h.waitFor("True/Enrolled once a ztunnel serves", func() bool { return h.conditionIs("app", "a", corev1.ConditionTrue, ReasonEnrolled) })
}
