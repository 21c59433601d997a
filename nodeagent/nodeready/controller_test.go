package nodeready

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// flipInputs are inputs a test changes between reconciles.
type flipInputs struct {
	mu     sync.Mutex
	plugin error
	synced bool
	zt     ZtunnelState
}

func (f *flipInputs) set(synced bool, zt ZtunnelState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.synced, f.zt = synced, zt
}

func (f *flipInputs) inputs() Inputs {
	return Inputs{
		PluginInstalled: func() error { f.mu.Lock(); defer f.mu.Unlock(); return f.plugin },
		AgentStarted:    func() bool { f.mu.Lock(); defer f.mu.Unlock(); return f.synced },
		Ztunnel:         func() ZtunnelState { f.mu.Lock(); defer f.mu.Unlock(); return f.zt },
		CNIServing:      func() bool { return true },
	}
}

// fakeClock is a clock the test moves by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time                         { return c.t }
func (c *fakeClock) step(d time.Duration)                   { c.t = c.t.Add(d) }
func newFakeClock() *fakeClock                              { return &fakeClock{t: time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC)} }
func taintOf(key string, e corev1.TaintEffect) corev1.Taint { return corev1.Taint{Key: key, Effect: e} }

type harness struct {
	c      *Controller
	client *fake.Clientset
	in     *flipInputs
	clock  *fakeClock
	rec    *record.FakeRecorder
	// informers are the controller's node informer's, which Run's caller
	// starts (as the daemon does).
	informers *kube.Informers
}

func newHarness(t *testing.T, cfg Config, taints ...corev1.Taint) *harness {
	t.Helper()
	cfg.NodeName = "n1"
	h := &harness{
		client: fake.NewClientset(
			&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}, Spec: corev1.NodeSpec{Taints: taints}},
			&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n2"}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{taintOf(DefaultTaintKey, corev1.TaintEffectNoSchedule)}}},
		),
		in:    &flipInputs{},
		clock: newFakeClock(),
		rec:   record.NewFakeRecorder(100),
	}
	client := kubetest.Wrap(h.client)
	h.informers = kube.NewInformers(client, cfg.NodeName)
	c, err := New(cfg, Deps{Client: client, Inputs: h.in.inputs(), Node: h.informers.Node, Recorder: h.rec, Now: h.clock.now})
	if err != nil {
		t.Fatal(err)
	}
	h.c = c
	return h
}

func (h *harness) reconcile(t *testing.T) time.Duration {
	t.Helper()
	after, err := h.c.reconcile(context.Background(), nil)
	if err != nil {
		t.Fatalf("reconcile: %v", err)
	}
	return after
}

func (h *harness) node(t *testing.T, name string) *corev1.Node {
	t.Helper()
	n, err := h.client.CoreV1().Nodes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (h *harness) events() []string {
	var out []string
	for {
		select {
		case e := <-h.rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

func TestReconcileUntaint(t *testing.T) {
	other := corev1.Taint{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoSchedule}
	h := newHarness(t, Config{Untaint: true}, other, taintOf(DefaultTaintKey, corev1.TaintEffectNoExecute))

	// Not ready: condition False with the reason, taint stays.
	h.reconcile(t)
	n := h.node(t, "n1")
	cond := findCondition(n, DefaultConditionType)
	if cond == nil || cond.Status != corev1.ConditionFalse || cond.Reason != ReasonCachesNotSynced {
		t.Fatalf("condition = %+v, want False/%s", cond, ReasonCachesNotSynced)
	}
	if !hasTaint(n.Spec.Taints, DefaultTaintKey) {
		t.Fatal("taint removed while not ready")
	}
	if st := h.c.Status(); st.Condition != corev1.ConditionFalse || !st.TaintPresent || !st.Written {
		t.Fatalf("status = %+v", st)
	}
	if ev := h.events(); len(ev) != 1 || !strings.Contains(ev[0], EventAmbientNotReady) {
		t.Fatalf("events = %q, want one %s", ev, EventAmbientNotReady)
	}
	falseAt := cond.LastTransitionTime

	// Same state again: no write (no new event, transition kept).
	h.clock.step(time.Minute)
	h.reconcile(t)
	if ev := h.events(); len(ev) != 0 {
		t.Fatalf("events on an unchanged reconcile: %q", ev)
	}
	if got := findCondition(h.node(t, "n1"), DefaultConditionType).LastTransitionTime; !got.Equal(&falseAt) {
		t.Fatalf("lastTransitionTime moved without a status change: %v -> %v", falseAt, got)
	}

	// Ready: True, our taint (any effect) removed, the other kept.
	h.in.set(true, ztReady)
	h.reconcile(t)
	n = h.node(t, "n1")
	if c := findCondition(n, DefaultConditionType); c.Status != corev1.ConditionTrue || c.Reason != ReasonReady {
		t.Fatalf("condition = %+v, want True", c)
	}
	if len(n.Spec.Taints) != 1 || n.Spec.Taints[0] != other {
		t.Fatalf("taints = %v, want only %v", n.Spec.Taints, other)
	}
	ev := h.events()
	if len(ev) != 2 || !strings.Contains(ev[0], EventAmbientReady) || !strings.Contains(ev[1], EventTaintRemoved) {
		t.Fatalf("events = %q, want %s then %s", ev, EventAmbientReady, EventTaintRemoved)
	}
	if st := h.c.Status(); st.Condition != corev1.ConditionTrue || st.TaintPresent {
		t.Fatalf("status = %+v", st)
	}

	// Unready again without --taint-when-unready: the taint is not added.
	h.in.set(true, ZtunnelState{})
	h.clock.step(time.Hour)
	h.reconcile(t)
	if n := h.node(t, "n1"); hasTaint(n.Spec.Taints, DefaultTaintKey) {
		t.Fatalf("taint added without --taint-when-unready: %v", n.Spec.Taints)
	}
	// The other node is never touched.
	if n2 := h.node(t, "n2"); !hasTaint(n2.Spec.Taints, DefaultTaintKey) || len(n2.Status.Conditions) != 0 {
		t.Fatalf("node n2 changed: %+v", n2)
	}
}

func TestReconcileUntaintOff(t *testing.T) {
	h := newHarness(t, Config{}, taintOf(DefaultTaintKey, corev1.TaintEffectNoSchedule))
	h.in.set(true, ztReady)
	h.reconcile(t)
	n := h.node(t, "n1")
	if c := findCondition(n, DefaultConditionType); c == nil || c.Status != corev1.ConditionTrue {
		t.Fatalf("condition = %+v, want True", c)
	}
	if !hasTaint(n.Spec.Taints, DefaultTaintKey) {
		t.Fatal("taint removed without --untaint")
	}
}

func TestReconcileTaintWhenUnreadyGrace(t *testing.T) {
	const grace = 30 * time.Second
	h := newHarness(t, Config{Untaint: true, TaintWhenUnready: true, TaintGracePeriod: grace, HeartbeatPeriod: time.Hour})
	// Mid-second: the stored lastTransitionTime is truncated, the grace
	// must still be measured from the precise transition.
	h.clock.step(900 * time.Millisecond)
	h.in.set(true, ztReady)
	h.reconcile(t)
	if hasTaint(h.node(t, "n1").Spec.Taints, DefaultTaintKey) {
		t.Fatal("tainted while ready")
	}
	h.events()

	// ztunnel goes away: False now, taint only after the grace.
	h.in.set(true, ZtunnelState{})
	if after := h.reconcile(t); after != grace {
		t.Fatalf("recheck after %v, want the grace %v", after, grace)
	}
	h.clock.step(grace - time.Second)
	if after := h.reconcile(t); after != time.Second {
		t.Fatalf("recheck after %v, want 1s", after)
	}
	if hasTaint(h.node(t, "n1").Spec.Taints, DefaultTaintKey) {
		t.Fatal("tainted before the grace period ended")
	}
	h.clock.step(time.Second)
	if after := h.reconcile(t); after < 59*time.Minute {
		t.Fatalf("recheck after %v once tainted, want only the next heartbeat's (about 1h)", after)
	}
	n := h.node(t, "n1")
	if len(n.Spec.Taints) != 1 || n.Spec.Taints[0] != taintOf(DefaultTaintKey, corev1.TaintEffectNoSchedule) {
		t.Fatalf("taints = %v, want %s:NoSchedule", n.Spec.Taints, DefaultTaintKey)
	}
	if ev := h.events(); len(ev) != 2 || !strings.Contains(ev[0], EventAmbientNotReady) || !strings.Contains(ev[1], EventTaintAdded) {
		t.Fatalf("events = %q", ev)
	}

	// Back: removed.
	h.in.set(true, ztReady)
	h.reconcile(t)
	if hasTaint(h.node(t, "n1").Spec.Taints, DefaultTaintKey) {
		t.Fatal("taint not removed when ready again")
	}
	// A short blip (False for less than the grace) never taints.
	h.in.set(true, ZtunnelState{})
	h.reconcile(t)
	h.clock.step(grace / 2)
	h.in.set(true, ztReady)
	h.reconcile(t)
	h.clock.step(grace)
	h.reconcile(t)
	if hasTaint(h.node(t, "n1").Spec.Taints, DefaultTaintKey) {
		t.Fatal("a blip shorter than the grace tainted the node")
	}
}

// The condition is rewritten every heartbeat period while nothing changes
// (only lastHeartbeatTime moves), and not in between: a True written by an
// agent that has since died reads stale.
func TestReconcileHeartbeat(t *testing.T) {
	h := newHarness(t, Config{HeartbeatPeriod: time.Minute})
	h.in.set(true, ztReady)
	h.reconcile(t)
	first := *findCondition(h.node(t, "n1"), DefaultConditionType)
	patches := func() int {
		n := 0
		for _, a := range h.client.Actions() {
			if a.GetVerb() == "patch" && a.GetSubresource() == "status" {
				n++
			}
		}
		return n
	}
	if patches() != 1 {
		t.Fatalf("%d status patches for the first write, want 1", patches())
	}
	h.clock.step(59 * time.Second)
	if after := h.reconcile(t); after != time.Second {
		t.Errorf("next look in %v, want 1s (the heartbeat)", after)
	}
	if patches() != 1 {
		t.Fatalf("rewritten before the heartbeat was due: %d patches", patches())
	}
	h.clock.step(time.Second)
	h.reconcile(t)
	c := findCondition(h.node(t, "n1"), DefaultConditionType)
	if patches() != 2 || !c.LastHeartbeatTime.Time.Equal(h.clock.now()) || !c.LastTransitionTime.Equal(&first.LastTransitionTime) ||
		c.Status != corev1.ConditionTrue || c.Reason != first.Reason {
		t.Fatalf("after a heartbeat period: %d patches, condition %+v (first %+v)", patches(), c, first)
	}
	if ev := h.events(); len(ev) != 1 {
		t.Errorf("a heartbeat recorded an Event: %q", ev)
	}
}

func TestNewValidates(t *testing.T) {
	in := fakeInputs(nil, true, ztReady)
	client := kubetest.Wrap(fake.NewClientset())
	node, rec := kube.NewInformers(client, "n").Node, record.NewFakeRecorder(1)
	tests := []struct {
		name string
		cfg  Config
		deps Deps
		want string
	}{
		{"no node", Config{}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec}, "--node-name is required"},
		{"bad node", Config{NodeName: "Bad_Node"}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec}, "--node-name"},
		{"bad condition type", Config{NodeName: "n", ConditionType: "a/b/c"}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec}, "--node-condition-type"},
		{"bad taint key", Config{NodeName: "n", TaintKey: "-x"}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec}, "--taint-key"},
		{"negative grace", Config{NodeName: "n", TaintGracePeriod: -time.Second}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec}, "--taint-grace-period"},
		{"tiny resync", Config{NodeName: "n", ResyncPeriod: time.Millisecond}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec}, "--node-condition-resync"},
		{"no client", Config{NodeName: "n"}, Deps{Inputs: in, Node: node, Recorder: rec}, "client"},
		{"no node informer", Config{NodeName: "n"}, Deps{Client: client, Inputs: in, Recorder: rec}, "informer"},
		{"no recorder", Config{NodeName: "n"}, Deps{Client: client, Inputs: in, Node: node}, "recorder"},
		{"missing input", Config{NodeName: "n"}, Deps{Client: client, Inputs: Inputs{AgentStarted: in.AgentStarted}, Node: node, Recorder: rec}, "inputs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg, tt.deps)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New error = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
	c, err := New(Config{NodeName: "n"}, Deps{Client: client, Inputs: in, Node: node, Recorder: rec})
	if err != nil {
		t.Fatal(err)
	}
	if c.cfg.ConditionType != DefaultConditionType || c.cfg.TaintKey != DefaultTaintKey || c.cfg.TaintGracePeriod != DefaultGracePeriod {
		t.Fatalf("defaults not applied: %+v", c.cfg)
	}
	if st := c.Status(); st.Condition != corev1.ConditionUnknown {
		t.Fatalf("initial status %+v, want Unknown", st)
	}
}

// TestRunNotifyAndStop drives Run with the fake client: a Notify after an
// input change is acted on without waiting for the resync, and Run returns
// nil when ctx ends.
func TestRunNotifyAndStop(t *testing.T) {
	h := newHarness(t, Config{Untaint: true, ResyncPeriod: time.Hour}, taintOf(DefaultTaintKey, corev1.TaintEffectNoSchedule))
	ctx, cancel := context.WithCancel(context.Background())
	h.informers.Start(ctx.Done())
	defer h.informers.Shutdown()
	done := make(chan error, 1)
	go func() { done <- h.c.Run(ctx) }()
	waitStatus := func(what string, ok func(Status) bool) {
		t.Helper()
		if !testutil.Wait(30*time.Second, func() bool { return ok(h.c.Status()) }) {
			t.Fatalf("timed out waiting for %s; status %+v", what, h.c.Status())
		}
	}
	waitStatus("condition False written", func(s Status) bool { return s.Condition == corev1.ConditionFalse && s.Written && s.TaintPresent })
	h.in.set(true, ztReady)
	h.c.Notify()
	waitStatus("taint removed", func(s Status) bool { return s.Condition == corev1.ConditionTrue && s.Written && !s.TaintPresent })
	if hasTaint(h.node(t, "n1").Spec.Taints, DefaultTaintKey) {
		t.Fatal("status says untainted but the node has the taint")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}

func TestStatusErr(t *testing.T) {
	tests := []struct {
		name string
		s    Status
		want string // "" = nil
	}{
		{"unknown", Status{Condition: corev1.ConditionUnknown}, "not evaluated"},
		{"false", Status{Condition: corev1.ConditionFalse, Reason: ReasonZtunnelNotConnected, Written: true}, ReasonZtunnelNotConnected},
		{"true, write failed", Status{Condition: corev1.ConditionTrue, LastError: "forbidden"}, "forbidden"},
		{"true and written", Status{Condition: corev1.ConditionTrue, Written: true}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.s.Err()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Err() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Err() = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

// An agent's start walks through False reasons (caches, ztunnel, snapshot)
// within a second: with Settle it costs one Node write (True) and one
// Event, not one per reason. A False that holds for Settle is written.
func TestReconcileSettlesFalse(t *testing.T) {
	const settle = 5 * time.Second
	h := newHarness(t, Config{Settle: settle, HeartbeatPeriod: time.Hour})
	writes := func() int {
		n := 0
		for _, a := range h.client.Actions() {
			if a.GetVerb() == "patch" && a.GetSubresource() == "status" {
				n++
			}
		}
		return n
	}
	if after := h.reconcile(t); after != settle { // CachesNotSynced
		t.Fatalf("next look in %v, want the settle %v", after, settle)
	}
	h.clock.step(time.Second)
	h.in.set(true, ZtunnelState{})
	h.reconcile(t) // ZtunnelNotConnected: the settle starts over
	h.clock.step(time.Second)
	h.in.set(true, ZtunnelState{Connected: true})
	h.reconcile(t) // SnapshotNotAcked
	if writes() != 0 {
		t.Fatalf("%d condition writes while walking to ready, want none", writes())
	}
	h.clock.step(time.Second)
	h.in.set(true, ztReady)
	h.reconcile(t)
	if c := findCondition(h.node(t, "n1"), DefaultConditionType); writes() != 1 || c == nil || c.Status != corev1.ConditionTrue {
		t.Fatalf("after the walk: %d writes, condition %+v; want one write, True", writes(), c)
	}
	if ev := h.events(); len(ev) != 1 || !strings.Contains(ev[0], EventAmbientReady) {
		t.Fatalf("events %q, want one %s", ev, EventAmbientReady)
	}

	// ztunnel goes: False only once it held for the settle.
	h.in.set(true, ZtunnelState{})
	if after := h.reconcile(t); after != settle || writes() != 1 {
		t.Fatalf("right after ztunnel went: next look in %v, %d writes; want %v, still 1", after, writes(), settle)
	}
	h.clock.step(settle)
	h.reconcile(t)
	c := findCondition(h.node(t, "n1"), DefaultConditionType)
	if writes() != 2 || c.Status != corev1.ConditionFalse || c.Reason != ReasonZtunnelNotConnected {
		t.Fatalf("after the settle: %d writes, condition %+v; want False/%s written", writes(), c, ReasonZtunnelNotConnected)
	}
	if ev := h.events(); len(ev) != 1 || !strings.Contains(ev[0], EventAmbientNotReady) {
		t.Fatalf("events %q, want one %s", ev, EventAmbientNotReady)
	}
}

// A True left on the node by an earlier agent (a restart) while this one
// is not ready yet and its False settles: the startup taint stays until
// this process itself finds the node ready.
func TestStaleTrueRemovesNoTaint(t *testing.T) {
	h := newHarness(t, Config{Settle: 5 * time.Second, Untaint: true}, taintOf(DefaultTaintKey, corev1.TaintEffectNoSchedule))
	n := h.node(t, "n1")
	n.Status.Conditions = []corev1.NodeCondition{{Type: DefaultConditionType, Status: corev1.ConditionTrue, Reason: ReasonReady,
		LastHeartbeatTime: metav1.NewTime(h.clock.now()), LastTransitionTime: metav1.NewTime(h.clock.now())}}
	if _, err := h.client.CoreV1().Nodes().UpdateStatus(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.reconcile(t) // CachesNotSynced, settling
	if n := h.node(t, "n1"); !hasTaint(n.Spec.Taints, DefaultTaintKey) {
		t.Fatalf("taint removed on an earlier agent's True while this one is not ready: %v", n.Spec.Taints)
	}
	h.in.set(true, ztReady)
	h.reconcile(t)
	if n := h.node(t, "n1"); hasTaint(n.Spec.Taints, DefaultTaintKey) {
		t.Fatalf("taint kept once ready: %v", n.Spec.Taints)
	}
}

// A ztunnel outage is announced by the agent (its ZtunnelUnavailable and
// ZtunnelAvailable Events count the pods); the condition's own Events
// for it would be a second Event each way on every node at once.
func TestOutageAnnouncedElsewhereIsOneEvent(t *testing.T) {
	served := ZtunnelState{Connected: true, SnapshotAcked: true}
	type step struct {
		synced bool
		zt     ZtunnelState
		want   string // the one Event recorded, "" none
	}
	for _, tc := range []struct {
		name      string
		elsewhere []string
		steps     []step
	}{
		{"ztunnel outage announced by the agent", ZtunnelReasons(), []step{
			{true, served, EventAmbientReady},
			{true, ZtunnelState{}, ""},
			{true, served, ""},
			{true, ZtunnelState{Connected: true}, ""},
			{true, served, ""},
		}},
		{"a False this controller announced is ended with an Event", ZtunnelReasons(), []step{
			{false, ZtunnelState{}, EventAmbientNotReady},
			{true, ZtunnelState{}, ""}, // reason moves to ZtunnelNotConnected: no transition
			{true, served, EventAmbientReady},
		}},
		{"nobody else announces: every transition", nil, []step{
			{true, served, EventAmbientReady},
			{true, ZtunnelState{}, EventAmbientNotReady},
			{true, served, EventAmbientReady},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{AnnouncedElsewhere: tc.elsewhere})
			for i, s := range tc.steps {
				h.in.set(s.synced, s.zt)
				h.clock.step(time.Second)
				h.reconcile(t)
				ev := h.events()
				switch {
				case s.want == "" && len(ev) != 0:
					t.Fatalf("step %d: events %q, want none", i, ev)
				case s.want != "" && (len(ev) != 1 || !strings.Contains(ev[0], " "+s.want+" ")):
					t.Fatalf("step %d: events %q, want one %s", i, ev, s.want)
				}
			}
		})
	}
}
