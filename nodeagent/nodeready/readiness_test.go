package nodeready

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/cniinstall"
)

// fakeInputs builds Inputs from fixed values, the CNI socket serving.
func fakeInputs(plugin error, synced bool, zt ZtunnelState) Inputs {
	return Inputs{
		PluginInstalled: func() error { return plugin },
		AgentStarted:    func() bool { return synced },
		Ztunnel:         func() ZtunnelState { return zt },
		CNIServing:      func() bool { return true },
	}
}

// notServing is in with the CNI socket not serving.
func notServing(in Inputs) Inputs {
	in.CNIServing = func() bool { return false }
	return in
}

var ztReady = ZtunnelState{Connected: true, SnapshotAcked: true}

func TestCompute(t *testing.T) {
	noPlugin := errors.New("no ambientd-cni entry in /etc/cni/net.d/10-calico.conflist")
	tests := []struct {
		name       string
		in         Inputs
		ready      bool
		reason     string
		msgContain []string
	}{
		{"all ready", fakeInputs(nil, true, ztReady), true, ReasonReady, nil},
		{"plugin missing", fakeInputs(noPlugin, true, ztReady), false, ReasonPluginNotInstalled, []string{"10-calico.conflist"}},
		{"an exclusive primary renamed ours away", fakeInputs(fmt.Errorf("%w: 00-ambientd.conflist renamed: %w", cniinstall.ErrExclusiveCNI, noPlugin), true, ztReady), false, ReasonExclusiveCNI,
			[]string{"CNI plugin not installed", "cni-exclusive", "00-ambientd.conflist renamed", "10-calico.conflist"}},
		{"caches not synced", fakeInputs(nil, false, ztReady), false, ReasonCachesNotSynced, nil},
		{"no ztunnel", fakeInputs(nil, true, ZtunnelState{}), false, ReasonZtunnelNotConnected, nil},
		{"not acked", fakeInputs(nil, true, ZtunnelState{Connected: true}), false, ReasonSnapshotNotAcked, nil},
		{"CNI socket not serving", notServing(fakeInputs(nil, true, ztReady)), false, ReasonCNISocketNotServing, []string{"CNI socket not serving"}},
		{"everything wrong: first reason, all messages", notServing(fakeInputs(noPlugin, false, ZtunnelState{})), false, ReasonPluginNotInstalled,
			[]string{"CNI plugin not installed", "caches not synced", "no ztunnel connected", "CNI socket not serving"}},
		{"ztunnel and caches", fakeInputs(nil, false, ZtunnelState{Connected: true}), false, ReasonCachesNotSynced,
			[]string{"caches not synced", "not acked"}},
		{"install lease not written", withLease(fakeInputs(nil, true, ztReady), errors.New("install lease: read-only file system")), false, ReasonInstallLeaseNotWritten,
			[]string{"install lease not written", "read-only file system"}},
		{"install lease written", withLease(fakeInputs(nil, true, ztReady), nil), true, ReasonReady, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Compute(tt.in)
			if r.Ready != tt.ready || r.Reason != tt.reason {
				t.Fatalf("Compute = %+v, want ready=%v reason=%s", r, tt.ready, tt.reason)
			}
			wantStatus := corev1.ConditionFalse
			if tt.ready {
				wantStatus = corev1.ConditionTrue
			}
			if r.Status() != wantStatus {
				t.Fatalf("Status() = %s, want %s", r.Status(), wantStatus)
			}
			for _, m := range tt.msgContain {
				if !strings.Contains(r.Message, m) {
					t.Errorf("message %q lacks %q", r.Message, m)
				}
			}
		})
	}
}

func TestDesiredCondition(t *testing.T) {
	const typ = corev1.NodeConditionType(DefaultConditionType)
	t0 := time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC)
	now := t0.Add(time.Hour)
	ready := Readiness{Ready: true, Reason: ReasonReady, Message: "ok"}
	notReady := Readiness{Reason: ReasonZtunnelNotConnected, Message: "no ztunnel connected"}
	cond := func(s corev1.ConditionStatus, reason, msg string) *corev1.NodeCondition {
		return &corev1.NodeCondition{Type: typ, Status: s, Reason: reason, Message: msg,
			LastTransitionTime: metav1.NewTime(t0), LastHeartbeatTime: metav1.NewTime(t0)}
	}
	tests := []struct {
		name        string
		cur         *corev1.NodeCondition
		r           Readiness
		wantChanged bool
		wantLTT     time.Time
	}{
		{"absent: written, transition now", nil, notReady, true, now},
		{"same status, reason and message: no write", cond(corev1.ConditionFalse, ReasonZtunnelNotConnected, "no ztunnel connected"), notReady, false, t0},
		{"status flips: transition now", cond(corev1.ConditionFalse, ReasonZtunnelNotConnected, "no ztunnel connected"), ready, true, now},
		{"reason changes, status same: transition kept", cond(corev1.ConditionFalse, ReasonCachesNotSynced, "x"), notReady, true, t0},
		{"message changes only: written, transition kept", cond(corev1.ConditionTrue, ReasonReady, "old"), ready, true, t0},
		{"Unknown set by someone else to False: transition now", cond(corev1.ConditionUnknown, "", ""), notReady, true, now},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, changed := desiredCondition(tt.cur, typ, tt.r, now, 2*time.Hour)
			if changed != tt.wantChanged {
				t.Fatalf("changed = %v, want %v", changed, tt.wantChanged)
			}
			if !got.LastTransitionTime.Time.Equal(tt.wantLTT) {
				t.Errorf("lastTransitionTime = %v, want %v", got.LastTransitionTime, tt.wantLTT)
			}
			if got.Type != typ || got.Status != tt.r.Status() || got.Reason != tt.r.Reason || got.Message != tt.r.Message {
				t.Errorf("condition = %+v, want type %s from %+v", got, typ, tt.r)
			}
		})
	}
}

// A condition that did not change is rewritten once its heartbeat is a
// period old, moving only lastHeartbeatTime: a dead agent's True goes stale.
func TestDesiredConditionHeartbeat(t *testing.T) {
	const typ = corev1.NodeConditionType(DefaultConditionType)
	t0 := time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC)
	ready := Readiness{Ready: true, Reason: ReasonReady, Message: "ok"}
	cur := &corev1.NodeCondition{Type: typ, Status: corev1.ConditionTrue, Reason: ReasonReady, Message: "ok",
		LastTransitionTime: metav1.NewTime(t0.Add(-time.Hour)), LastHeartbeatTime: metav1.NewTime(t0)}
	for _, tt := range []struct {
		name    string
		age     time.Duration
		period  time.Duration
		want    bool
		wantDue time.Duration
	}{
		{"fresh", 59 * time.Second, time.Minute, false, time.Second},
		{"a period old", time.Minute, time.Minute, true, 0},
		{"older", 10 * time.Minute, time.Minute, true, 0},
		{"no heartbeat", 10 * time.Minute, 0, false, -1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			now := t0.Add(tt.age)
			got, changed := desiredCondition(cur, typ, ready, now, tt.period)
			if changed != tt.want {
				t.Fatalf("changed = %v, want %v", changed, tt.want)
			}
			if !got.LastHeartbeatTime.Time.Equal(now) || !got.LastTransitionTime.Equal(&cur.LastTransitionTime) {
				t.Errorf("heartbeat %v (want %v), transition %v (want %v)", got.LastHeartbeatTime, now, got.LastTransitionTime, cur.LastTransitionTime)
			}
			if due := heartbeatIn(cur, tt.period, now); due != tt.wantDue {
				t.Errorf("heartbeat due in %v, want %v", due, tt.wantDue)
			}
		})
	}
}

func TestRetaintDue(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC)
	falseSince := &corev1.NodeCondition{Status: corev1.ConditionFalse, LastTransitionTime: metav1.NewTime(t0)}
	trueSince := &corev1.NodeCondition{Status: corev1.ConditionTrue, LastTransitionTime: metav1.NewTime(t0)}
	unknown := &corev1.NodeCondition{Status: corev1.ConditionUnknown, LastTransitionTime: metav1.NewTime(t0)}
	const grace = 30 * time.Second
	tests := []struct {
		name     string
		cond     *corev1.NodeCondition
		now      time.Time
		wantDue  bool
		wantWait time.Duration
	}{
		{"no condition", nil, t0.Add(time.Hour), false, 0},
		{"True", trueSince, t0.Add(time.Hour), false, 0},
		{"Unknown is not False", unknown, t0.Add(time.Hour), false, 0},
		{"False just now: wait the full grace", falseSince, t0, false, grace},
		{"False 29.5s: wait 0.5s", falseSince, t0.Add(29500 * time.Millisecond), false, 500 * time.Millisecond},
		{"False exactly the grace: due", falseSince, t0.Add(grace), true, 0},
		{"False long ago: due", falseSince, t0.Add(time.Hour), true, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			due, wait := retaintDue(tt.cond, t0, grace, tt.now)
			if due != tt.wantDue || wait != tt.wantWait {
				t.Fatalf("retaintDue = %v, %v; want %v, %v", due, wait, tt.wantDue, tt.wantWait)
			}
		})
	}
}

func TestFalseSince(t *testing.T) {
	ltt := time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC) // the API keeps seconds only
	cond := &corev1.NodeCondition{Status: corev1.ConditionFalse, LastTransitionTime: metav1.NewTime(ltt)}
	tests := []struct {
		name  string
		wrote time.Time
		want  time.Time
	}{
		{"not written by us (restart): the stored time", time.Time{}, ltt},
		{"written by us 0.7s into the second: the precise time", ltt.Add(700 * time.Millisecond), ltt.Add(700 * time.Millisecond)},
		{"our write is an older transition: the stored time", ltt.Add(-time.Hour), ltt},
		{"our write is from another second: the stored time", ltt.Add(3 * time.Second), ltt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := falseSince(cond, tt.wrote); !got.Equal(tt.want) {
				t.Fatalf("falseSince = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestTaintEdits(t *testing.T) {
	const key = DefaultTaintKey
	other := corev1.Taint{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoSchedule}
	ours := corev1.Taint{Key: key, Value: "true", Effect: corev1.TaintEffectNoSchedule}
	oursExec := corev1.Taint{Key: key, Effect: corev1.TaintEffectNoExecute}

	if got := withoutTaint([]corev1.Taint{other, ours, oursExec}, key); len(got) != 1 || got[0] != other {
		t.Errorf("withoutTaint removed the wrong taints: %v", got)
	}
	if got := withoutTaint(nil, key); len(got) != 0 {
		t.Errorf("withoutTaint(nil) = %v", got)
	}
	in := []corev1.Taint{other}
	got := withTaint(in, key)
	if len(got) != 2 || got[0] != other || got[1] != (corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule}) {
		t.Errorf("withTaint = %v", got)
	}
	if len(in) != 1 {
		t.Errorf("withTaint modified its input: %v", in)
	}
	if got := withTaint([]corev1.Taint{oursExec}, key); len(got) != 1 {
		t.Errorf("withTaint added a second taint for a key present with another effect: %v", got)
	}
	if !hasTaint([]corev1.Taint{other, oursExec}, key) || hasTaint([]corev1.Taint{other}, key) {
		t.Error("hasTaint wrong")
	}
}

func TestTaintPatch(t *testing.T) {
	other := corev1.Taint{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoSchedule}
	ours := corev1.Taint{Key: DefaultTaintKey, Effect: corev1.TaintEffectNoSchedule}
	tests := []struct {
		name       string
		have, want []corev1.Taint
		ops        string // expected patch, JSON
	}{
		{"remove one of two: test the old array, replace",
			[]corev1.Taint{other, ours}, []corev1.Taint{other},
			`[{"op":"test","path":"/spec/taints","value":[{"key":"dedicated","value":"gpu","effect":"NoSchedule"},{"key":"cni.istio.io/not-ready","effect":"NoSchedule"}]},` +
				`{"op":"replace","path":"/spec/taints","value":[{"key":"dedicated","value":"gpu","effect":"NoSchedule"}]}]`},
		{"remove the only one: test, remove the field",
			[]corev1.Taint{ours}, nil,
			`[{"op":"test","path":"/spec/taints","value":[{"key":"cni.istio.io/not-ready","effect":"NoSchedule"}]},{"op":"remove","path":"/spec/taints","value":null}]`},
		{"add to none: test absent (null), add",
			nil, []corev1.Taint{ours},
			`[{"op":"test","path":"/spec/taints","value":null},{"op":"add","path":"/spec/taints","value":[{"key":"cni.istio.io/not-ready","effect":"NoSchedule"}]}]`},
		{"add to others: test, replace",
			[]corev1.Taint{other}, []corev1.Taint{other, ours},
			`[{"op":"test","path":"/spec/taints","value":[{"key":"dedicated","value":"gpu","effect":"NoSchedule"}]},` +
				`{"op":"replace","path":"/spec/taints","value":[{"key":"dedicated","value":"gpu","effect":"NoSchedule"},{"key":"cni.istio.io/not-ready","effect":"NoSchedule"}]}]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := taintPatch(tt.have, tt.want)
			if err != nil {
				t.Fatal(err)
			}
			if !jsonEqual(t, p, []byte(tt.ops)) {
				t.Fatalf("patch\n got %s\nwant %s", p, tt.ops)
			}
		})
	}
}

func TestConditionPatch(t *testing.T) {
	t0 := metav1.NewTime(time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC))
	p, err := conditionPatch(corev1.NodeCondition{Type: DefaultConditionType, Status: corev1.ConditionFalse,
		Reason: ReasonCachesNotSynced, Message: "m", LastHeartbeatTime: t0, LastTransitionTime: t0})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"status":{"conditions":[{"type":"ambient.istio.io/NodeReady","status":"False","reason":"CachesNotSynced","message":"m",` +
		`"lastHeartbeatTime":"2026-01-01T10:00:00Z","lastTransitionTime":"2026-01-01T10:00:00Z"}]}}`
	if !jsonEqual(t, p, []byte(want)) {
		t.Fatalf("patch\n got %s\nwant %s", p, want)
	}
}

func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("unmarshal %s: %v", a, err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("unmarshal %s: %v", b, err)
	}
	xb, _ := json.Marshal(x)
	yb, _ := json.Marshal(y)
	return string(xb) == string(yb)
}

// withLease sets the install lease input to answer err.
func withLease(in Inputs, err error) Inputs {
	in.InstallLease = func() error { return err }
	return in
}
