package main

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
)

// TestClassify: what one probe connection's answer means.
func TestClassify(t *testing.T) {
	for _, c := range []struct {
		name, line string
		err        error
		own        string // the pod's own proxy's answer ("" for an ambient pod)
		want       outcome
	}{
		{"the emulator for this pod", "ztunnel-emulator uid=u1 listener=15001 orig_dst=10.88.0.2:7000", nil, "", outProxy},
		{"the emulator for another pod", "ztunnel-emulator uid=u2 listener=15001 orig_dst=10.88.0.2:7000", nil, "", outForeign},
		{"a uid that only starts the same", "ztunnel-emulator uid=u10 listener=15006 orig_dst=x", nil, "", outForeign},
		{"the far end itself", "remote", nil, "", outDirect},
		{"refused or timed out", "", errors.New("connection refused"), "", outDead},
		{"garbage", "hello", nil, "", outForeign},
		{"a sidecar pod's own proxy", "sidecar sc1", nil, "sidecar sc1", outSidecar},
		{"another sidecar pod's proxy", "sidecar sc2", nil, "sidecar sc1", outForeign},
		{"a sidecar answer to an ambient pod", "sidecar sc1", nil, "", outForeign},
		{"the emulator for a sidecar pod", "ztunnel-emulator uid=u1 listener=15001 orig_dst=x", nil, "sidecar sc1", outProxy},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := classify(c.line, c.err, "u1", "remote", c.own); got != c.want {
				t.Errorf("classify(%q, %v) = %v, want %v", c.line, c.err, got, c.want)
			}
		})
	}
}

// TestCombine: a pod's state from both directions; one direct direction
// is never "meshed".
func TestCombine(t *testing.T) {
	for _, c := range []struct {
		out, in outcome
		want    state
	}{
		{outProxy, outProxy, stMeshed},
		{outDirect, outDirect, stPlain},
		{outDirect, outProxy, stPartial},
		{outProxy, outDirect, stPartial},
		{outDead, outDirect, stPartial},
		{outDead, outProxy, stBlackHole},
		{outDead, outDead, stBlackHole},
		{outForeign, outProxy, stForeign},
		{outSidecar, outSidecar, stSidecar},
		{outSidecar, outDirect, stPartial},
		{outSidecar, outDead, stBlackHole},
	} {
		if got := combine(c.out, c.in); got != c.want {
			t.Errorf("combine(%v, %v) = %v, want %v", c.out, c.in, got, c.want)
		}
	}
}

// TestClaimEnrolled: which API claims count as "enrolled" — True/NotInMesh
// is one only for a pod that belongs in the mesh.
func TestClaimEnrolled(t *testing.T) {
	for _, c := range []struct {
		name string
		c    claim
		want bool
		in   bool // policy says in the mesh
	}{
		{"annotation enabled", claim{annotation: true}, true, false},
		{"condition True Enrolled", claim{condition: true}, true, false},
		{"True/NotInMesh out of the mesh", claim{condition: true, notInMesh: true}, false, false},
		{"True/NotInMesh but belongs in the mesh", claim{condition: true, notInMesh: true}, true, true},
		{"nothing", claim{}, false, true},
	} {
		if got := c.c.enrolled(c.in); got != c.want {
			t.Errorf("%s: enrolled(%v) = %v, want %v", c.name, c.in, got, c.want)
		}
	}
}

// TestBadRun: a run is reported once, when it reaches the bound, and its
// length is recorded when it ends.
func TestBadRun(t *testing.T) {
	rec := newRecorder(time.Now())
	var b badRun
	t0 := time.Now()
	steps := []struct {
		bad        bool
		at         time.Duration
		wantReport bool
	}{
		{true, 0, false},
		{true, 2 * time.Second, false},
		{true, 3 * time.Second, true},
		{true, 4 * time.Second, false}, // reported once
		{false, 5 * time.Second, false},
		{true, 6 * time.Second, false}, // a new run
	}
	for i, s := range steps {
		if _, got := b.observe(rec, kindBypass, s.bad, t0.Add(s.at), 3*time.Second); got != s.wantReport {
			t.Errorf("step %d: reported %v, want %v", i, got, s.wantReport)
		}
	}
	if w := rec.windows[kindBypass]; len(w) != 1 || w[0] != 5*time.Second {
		t.Errorf("windows %v, want one of 5s", w)
	}
}

// TestFaultRecovery: each fault that ran is measured from its end to the
// round that saw every pod back, once; a fault that failed to run is not.
func TestFaultRecovery(t *testing.T) {
	rec := newRecorder(time.Now())
	a := rec.faultStarted("agent-kill")
	b := rec.faultStarted("ztunnel-kill")
	rec.faultFinished(a, "", nil)
	rec.faultFinished(b, "", errors.New("did not run"))
	ends := rec.pendingRecoveries()
	if len(ends) != 1 || ends[a].IsZero() {
		t.Fatalf("pending %v, want only fault %d", ends, a)
	}
	rec.faultRecovered(a, ends[a].Add(700*time.Millisecond))
	rec.faultRecovered(a, ends[a].Add(5*time.Second)) // measured once
	if got := rec.recovery[a]; got != 700*time.Millisecond || len(rec.pendingRecoveries()) != 0 {
		t.Errorf("recovery %v (pending %v), want 700ms and none pending", got, rec.pendingRecoveries())
	}
}

// TestOverlaps: whether a fault of a kind was in flight in an interval
// (a sidecar pod made then may have missed our plugin).
func TestOverlaps(t *testing.T) {
	rec := newRecorder(time.Now())
	id := rec.faultStarted("owned-conflist-deleted")
	start := rec.faults[id].Start
	if !rec.overlaps("owned-conflist-deleted", start.Add(-time.Second), start.Add(time.Second)) {
		t.Error("a fault in flight does not overlap")
	}
	rec.faultFinished(id, "", nil)
	end := rec.faults[id].End
	for _, c := range []struct {
		name     string
		from, to time.Time
		kind     string
		want     bool
	}{
		{"before it", start.Add(-2 * time.Second), start.Add(-time.Second), "owned-conflist-deleted", false},
		{"after it", end.Add(time.Second), end.Add(2 * time.Second), "owned-conflist-deleted", false},
		{"across its end", end.Add(-time.Nanosecond), end.Add(time.Second), "owned-conflist-deleted", true},
		{"another kind", start, end, "agent-kill", false},
	} {
		if got := rec.overlaps(c.kind, c.from, c.to); got != c.want {
			t.Errorf("%s: overlaps = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestSidecarPolicy: a sidecar pod made through our plugin must be
// captured for its own proxy; one made without it may be plain until
// something captures it (a restarted agent does), and is held to that
// from then on; a sidecar pod is never in the mesh, whatever its labels.
func TestSidecarPolicy(t *testing.T) {
	ambient := &nsRec{name: "a", ambient: true}
	steps := []struct {
		name    string
		r       *podRec
		observe []state
		want    state
	}{
		{"made through our plugin", &podRec{ns: ambient, sidecar: true, sidecarRules: true}, nil, stSidecar},
		{"made without our plugin", &podRec{ns: ambient, sidecar: true}, nil, stPlain},
		{"made without, still plain", &podRec{ns: ambient, sidecar: true}, []state{stPlain, stPlain}, stPlain},
		{"made without, then captured", &podRec{ns: ambient, sidecar: true}, []state{stPlain, stSidecar}, stSidecar},
		{"captured, then plain again", &podRec{ns: ambient, sidecar: true}, []state{stSidecar, stPlain}, stSidecar},
		{"labelled ambient", &podRec{ns: ambient, sidecar: true, sidecarRules: true, podMode: "ambient"}, nil, stSidecar},
		{"an ambient pod", &podRec{ns: ambient}, []state{stSidecar}, stMeshed},
	}
	for _, c := range steps {
		for _, st := range c.observe {
			observeSidecar(c.r, st)
		}
		if got := policyState(c.r); got != c.want {
			t.Errorf("%s: policy state %v, want %v", c.name, got, c.want)
		}
		if c.r.sidecar && wantMesh(c.r) {
			t.Errorf("%s: a sidecar pod wanted in the mesh", c.name)
		}
	}
}

// TestAgentClocks: the verdicts' clocks of an agent restart are the
// soak's own actions: out from the stop signal to the start action (the
// bypass clock waits), gone from the process's exit to the start action
// (an ADD wholly inside it found no agent).
func TestAgentClocks(t *testing.T) {
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	rec := newRecorder(t0)
	rec.agentSignalled(at(100))
	rec.agentExited(at(300))
	if !rec.agentOutAt(at(5000)) || !rec.agentGoneThrough(at(400), at(5000)) {
		t.Fatal("an agent not started again is not out and gone")
	}
	rec.agentStarting(at(2000))
	for _, c := range []struct {
		name     string
		from, to int
		out      bool // agentOutAt(from)
		gone     bool // agentGoneThrough(from, to)
	}{
		{"before the signal", 50, 60, false, false},
		{"signalled, not yet exited", 200, 250, true, false},
		{"an ADD across the exit", 250, 500, true, false},
		{"an ADD while gone", 400, 1900, true, true},
		{"an ADD across the start", 1900, 2100, true, false},
		{"after the start", 2100, 2200, false, false},
	} {
		if got := rec.agentOutAt(at(c.from)); got != c.out {
			t.Errorf("%s: out = %v, want %v", c.name, got, c.out)
		}
		if got := rec.agentGoneThrough(at(c.from), at(c.to)); got != c.gone {
			t.Errorf("%s: gone through = %v, want %v", c.name, got, c.gone)
		}
	}
	if got := rec.goneSince(at(1500)); !got.Equal(at(300)) {
		t.Errorf("gone since %v, want the exit at 300ms", got.Sub(t0))
	}
	if got := rec.goneSince(at(2100)); !got.IsZero() {
		t.Errorf("gone since %v after the start, want zero", got.Sub(t0))
	}
	rec.agentSignalled(at(3000))
	if !rec.agentOutAt(at(3500)) || rec.agentOutAt(at(2500)) {
		t.Error("a second restart: out only after its signal")
	}
}

// TestUnservedClock: an outage runs from the soak's kill of every ztunnel
// until a round whose reads began after it saw one serve (a round begun
// before the kill proves nothing about after it); a restarted agent served
// a ztunnel at the first such round after its start.
func TestUnservedClock(t *testing.T) {
	t0 := time.Now()
	rec := newRecorder(t0)
	kill := t0.Add(time.Second)
	rec.ztunnelsKilled(kill)
	rec.ztunnelServed(kill.Add(-time.Millisecond))
	if !rec.unserved().Equal(kill) {
		t.Fatalf("a round begun before the kill ended the outage")
	}
	rec.ztunnelServed(kill.Add(time.Millisecond))
	if !rec.unserved().IsZero() {
		t.Fatalf("a round begun after the kill saw a ztunnel serve: the outage is still open at %v", rec.unserved())
	}

	// A restart: the first round begun after its action that sees a
	// ztunnel serve is when the new agent served one; later rounds do not
	// move it.
	start := t0.Add(5 * time.Second)
	rec.agentStarting(start)
	rec.ztunnelServed(start.Add(-time.Millisecond))
	if got := rec.servedSince(start); !got.IsZero() {
		t.Fatalf("a round begun before the restart counted as serving the new agent (%v)", got)
	}
	rec.ztunnelServed(start.Add(800 * time.Millisecond))
	rec.ztunnelServed(start.Add(1200 * time.Millisecond))
	if got := rec.servedSince(start); !got.Equal(start.Add(800 * time.Millisecond)) {
		t.Fatalf("served since %v, want the first round after the restart", got.Sub(start))
	}
}

// TestUnservedBound: the grace in the agent's flags (the last wins) plus
// the slack; 0 (the promise off) is held to the default.
func TestUnservedBound(t *testing.T) {
	for _, c := range []struct {
		args []string
		want time.Duration
	}{
		{nil, 7 * time.Second},
		{[]string{"--ztunnel-grace=10s"}, 12 * time.Second},
		{[]string{"--ztunnel-grace", "3s"}, 5 * time.Second},
		{[]string{"-ztunnel-grace=1s", "--ztunnel-grace=2s"}, 4 * time.Second},
		{[]string{"--ztunnel-grace=0"}, 7 * time.Second},
		{[]string{"--verify-interval=1s"}, 7 * time.Second},
	} {
		if got := unservedBound(config{agentArgs: c.args}); got != c.want {
			t.Errorf("unservedBound(%q) = %v, want %v", c.args, got, c.want)
		}
	}
}

// TestPlainRefused: a failed ADD of a pod outside the mesh is a violation
// only when the plugin could have let it start: wholly while no agent
// process ran, the API server up (no apiserver-stop in flight), the
// runtime's config ours throughout, the pod's policy unchanged since
// before it, and the error a plugin's. The counts of countAbsent follow
// the same conditions.
func TestPlainRefused(t *testing.T) {
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	refused := &types.Error{Code: 11, Msg: "ambientd agent unreachable"}
	for _, c := range []struct {
		name     string
		mesh     bool
		policy   int // policySince
		from, to int
		err      error
		want     bool
		counted  bool // as a plain pod refused (countAbsent: any error)
	}{
		{"a plain pod refused while gone", false, 0, 400, 600, refused, true, true},
		{"a mesh pod refused while gone", true, 0, 400, 600, refused, false, false},
		{"a plain pod refused across the agent's exit", false, 0, 200, 400, refused, false, false},
		{"a plain pod refused across the agent's start", false, 0, 4900, 5100, refused, false, false},
		{"a plain pod refused while the API server was stopped", false, 0, 1500, 1600, refused, false, false},
		{"a plain pod refused across the API server's resume", false, 0, 1900, 2100, refused, false, false},
		{"a plain pod refused while the primary rewrote its file", false, 0, 3100, 3200, refused, false, false},
		{"a pod relabelled plain during its ADD", false, 450, 400, 600, refused, false, false},
		{"not a plugin's error (the API create failed)", false, 0, 400, 600, errors.New("create pod: timeout"), false, true},
	} {
		s := &soak{rec: newRecorder(t0)}
		s.rec.agentSignalled(at(100))
		s.rec.agentExited(at(300))
		s.rec.agentStarting(at(5000))
		s.rec.faults = append(s.rec.faults,
			faultRec{Kind: "apiserver-stop", Start: at(1000), End: at(2000), done: true},
			faultRec{Kind: "primary-rewritten", Start: at(3000), End: at(3500), done: true})
		s.judgePlainRefused("ns/p", c.mesh, at(c.policy), at(c.from), at(c.to), fmt.Errorf("CNI ADD: %w", c.err))
		if got := len(s.rec.violations) == 1 && s.rec.violations[0].Kind == kindPlainRefused; got != c.want {
			t.Errorf("%s: violation %v (%v), want %v", c.name, got, s.rec.violations, c.want)
		}
		s.countAbsent(c.mesh, false, at(c.policy), at(c.from), at(c.to))
		if got := s.absentAdds[0][0].Load() == 1; got != c.counted {
			t.Errorf("%s: counted as a plain pod refused: %v", c.name, got)
		}
	}
}

// TestAgentOutBetween: the follow of the runtime's config is judged only
// when the soak had the agent running all along.
func TestAgentOutBetween(t *testing.T) {
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	rec := newRecorder(t0)
	rec.agentSignalled(at(1000))
	rec.agentStarting(at(2000))
	rec.agentSignalled(at(4000)) // still out
	for _, c := range []struct {
		name     string
		from, to int
		want     bool
	}{
		{"before", 0, 900, false},
		{"across the stop", 900, 1100, true},
		{"inside", 1200, 1300, true},
		{"between", 2100, 3900, false},
		{"across the second stop, never started", 3900, 9000, true},
	} {
		if got := rec.agentOutBetween(at(c.from), at(c.to)); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// TestFollowAllowed: the follow of the runtime's config is held to 10 s,
// plus the installer's loop-guard delay once the soak's own conflist
// faults of the last minute are more than its repair limit (5).
func TestFollowAllowed(t *testing.T) {
	t0 := time.Now()
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	for _, c := range []struct {
		name   string
		starts []int // seconds, alternating the two kinds
		want   time.Duration
	}{
		{"one", []int{100}, followBound},
		{"five in a minute", []int{60, 70, 80, 90, 100}, followBound},
		{"six in a minute", []int{50, 60, 70, 80, 90, 100}, followBound + 2*time.Second},
		{"six, the first a minute before", []int{39, 60, 70, 80, 90, 100}, followBound},
		{"eight in a minute", []int{44, 52, 60, 70, 80, 90, 95, 100}, followBound + 8*time.Second},
		{"twenty in a minute", []int{81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100}, followBound + time.Minute},
	} {
		s := &soak{rec: newRecorder(t0)}
		for i, st := range c.starts {
			s.rec.faults = append(s.rec.faults, faultRec{Kind: conflistFaults[i%2], Start: at(st), End: at(st), done: true})
		}
		s.rec.faults = append(s.rec.faults, faultRec{Kind: "agent-kill", Start: at(99), End: at(99), done: true})
		if got := s.followAllowed(at(100)); got != c.want {
			t.Errorf("%s: bound %v, want %v", c.name, got, c.want)
		}
	}
}
