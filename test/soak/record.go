package main

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Violation kinds.
const (
	kindBypass    = "bypass"
	kindBlackHole = "black hole while served"
	kindLost      = "lost pod"
	kindLeak      = "leak"
	kindStuck     = "node not restored"
	// kindRestored: a pod whose rules were wiped while the agent was down
	// is claimed enrolled with its traffic direct after the restarted
	// agent was ready (it verifies what it restores before that).
	kindRestored = "restored unverified"
	// kindSidecar: a sidecar-mode pod claimed enrolled in ambient, handed
	// to a ztunnel, or answered for by one.
	kindSidecar = "sidecar pod in ambient"
	// kindUnservedReady: a pod's enrolled condition True (Ready, in the
	// mesh) while no ztunnel has served the node for longer than the
	// agent's grace + unservedSlack.
	kindUnservedReady = "ready while unserved"
	// kindAbsentAdd: an ADD through our plugin succeeded for a pod in the
	// mesh while no agent process ran (it starts uncaptured).
	kindAbsentAdd = "mesh pod added without an agent"
	// kindDNSBypass: an ambient pod claimed enrolled whose DNS query the
	// nameserver answered itself, not its ztunnel's DNS port (DNS capture
	// on, the agent's default).
	kindDNSBypass = "DNS bypass"
	// kindPlainRefused: an ADD through our plugin failed for a pod outside
	// the mesh while no agent process ran and the API server was up: the
	// plugin must let it start (it can tell from the API).
	kindPlainRefused = "plain pod refused while the API was up"
	// kindNotFollowed: the runtime's config did not run our plugin with
	// the primary's latest text (or at all) within followBound of a
	// change, the agent running all along.
	kindNotFollowed = "conflist not followed"
)

type violation struct {
	At     time.Time
	Kind   string
	Pod    string
	UID    string
	Detail string
	// Faults in flight when it began, and the last one that ended before.
	InFlight []string
	LastEnd  string
	Log      []string // the agent's log lines around it (attachLogs)
}

type faultRec struct {
	Kind       string
	Start, End time.Time
	Detail     string
	Err        error
	done       bool
}

// round is one sampler round, for the timeline.
type round struct {
	At        time.Duration // since the start
	Counts    [numStates]int
	Bypassing int
	Served    bool
}

// recorder holds what the run saw; every method is safe for concurrent use.
type recorder struct {
	start   time.Time
	samples atomic.Int64

	mu           sync.Mutex
	faults       []faultRec
	inFlight     int
	lastFaultEnd time.Time
	// The open recovery window: from lastFaultEnd until every pod is in
	// its policy state.
	windowOpen bool
	recoveries []time.Duration
	violations []violation
	rounds     []round
	gaps       []time.Duration
	// windows: the length of every bypass and every black hole while
	// served, within the bounds or not.
	windows map[string][]time.Duration
	// pending are the faults (by index) whose recovery is not measured
	// yet: from each one's end to the first round in which every pod
	// unchanged since before that end was in its policy state.
	pending []int
	// recovery is, per fault (by index), that time; unrecovered counts
	// those still pending when the run settled.
	recovery map[int]time.Duration

	// The soak's own actions on the node's processes, the clocks of the
	// verdicts (never the agent's word): agentOut runs from the signal
	// that stops the agent to the action that starts it again, agentGone
	// from the moment its process exited to that action (open: to is
	// zero); unservedSince is when the soak killed every ztunnel, until a
	// sampler round whose reads began later saw one serve (zero then).
	agentOut, agentGone []span
	unservedSince       time.Time
	// servedAfter: for each restart action (by its time), the start of
	// the first sampler round that saw a ztunnel serve after it: the
	// emulator had the restarted agent's snapshot by then.
	servedAfter map[time.Time]time.Time
}

// span is a stretch of time; to is zero while it lasts.
type span struct{ from, to time.Time }

func (s span) covers(from, to time.Time) bool {
	return !s.from.After(from) && (s.to.IsZero() || !s.to.Before(to))
}

func newRecorder(start time.Time) *recorder {
	return &recorder{start: start, lastFaultEnd: start, windows: map[string][]time.Duration{}, recovery: map[int]time.Duration{}, servedAfter: map[time.Time]time.Time{}}
}

func (r *recorder) faultStarted(kind string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.faults = append(r.faults, faultRec{Kind: kind, Start: time.Now()})
	r.inFlight++
	r.windowOpen = false
	return len(r.faults) - 1
}

func (r *recorder) faultFinished(id int, detail string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := &r.faults[id]
	f.End, f.Detail, f.Err, f.done = time.Now(), detail, err, true
	r.inFlight--
	if err == nil {
		r.pending = append(r.pending, id)
	}
}

// pendingRecoveries are the ends of the faults whose recovery is still
// measured, by fault index.
func (r *recorder) pendingRecoveries() map[int]time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[int]time.Time, len(r.pending))
	for _, id := range r.pending {
		out[id] = r.faults[id].End
	}
	return out
}

// faultRecovered records that every pod was in its policy state at t, for
// the pending fault id.
func (r *recorder) faultRecovered(id int, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := slices.Index(r.pending, id)
	if i < 0 {
		return
	}
	r.pending = slices.Delete(r.pending, i, i+1)
	r.recovery[id] = max(t.Sub(r.faults[id].End), 0)
}

// overlaps reports whether a fault of kind was in flight at some time
// between from and to.
func (r *recorder) overlaps(kind string, from, to time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, f := range r.faults {
		if f.Kind == kind && !f.Start.After(to) && (!f.done || !f.End.Before(from)) {
			return true
		}
	}
	return false
}

// startedBetween counts the faults of kind that started from from to to.
func (r *recorder) startedBetween(kind string, from, to time.Time) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, f := range r.faults {
		if f.Kind == kind && !f.Start.Before(from) && !f.Start.After(to) {
			n++
		}
	}
	return n
}

// faultEnded marks the end of a storm (every fault undone): the lost-pod
// clock and a recovery window start.
func (r *recorder) faultEnded(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lastFaultEnd, r.windowOpen = t, true
}

// agentSignalled records that the soak signalled the agent to stop (at t).
func (r *recorder) agentSignalled(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.agentOut = append(r.agentOut, span{from: t})
}

// agentExited records that the agent's process was gone at t.
func (r *recorder) agentExited(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.agentGone = append(r.agentGone, span{from: t})
}

// agentStarting records the soak's action that starts the agent again (at
// t, just before it does): the open spans end.
func (r *recorder) agentStarting(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.servedAfter[t] = time.Time{}
	for _, l := range [][]span{r.agentOut, r.agentGone} {
		if n := len(l); n > 0 && l[n-1].to.IsZero() {
			l[n-1].to = t
		}
	}
}

// agentOutAt: at t the soak had stopped the agent and not started it
// again: nobody could correct a pod's claim, so the bypass clock runs from
// the restart action.
func (r *recorder) agentOutAt(t time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range slices.Backward(r.agentOut) {
		if s.covers(t, t) {
			return true
		}
	}
	return false
}

// agentOutBetween: the soak had the agent stopped at some moment from
// from to to.
func (r *recorder) agentOutBetween(from, to time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.agentOut {
		if !s.from.After(to) && (s.to.IsZero() || !s.to.Before(from)) {
			return true
		}
	}
	return false
}

// goneSince is when the agent's process exited, if none ran at t (zero
// otherwise).
func (r *recorder) goneSince(t time.Time) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range slices.Backward(r.agentGone) {
		if s.covers(t, t) {
			return s.from
		}
	}
	return time.Time{}
}

// agentGoneThrough: no agent process ran at any time from from to to.
func (r *recorder) agentGoneThrough(from, to time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.agentGone {
		if s.covers(from, to) {
			return true
		}
	}
	return false
}

// ztunnelsKilled records that the soak killed every ztunnel at t.
func (r *recorder) ztunnelsKilled(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.unservedSince = t
}

// ztunnelServed: a sampler round whose reads began at t0 saw a ztunnel
// serve; an outage the soak made before t0 is over, and an agent started
// before t0 gave the ztunnel its snapshot.
func (r *recorder) ztunnelServed(t0 time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for start, served := range r.servedAfter {
		if served.IsZero() && start.Before(t0) {
			r.servedAfter[start] = t0
		}
	}
	if !r.unservedSince.IsZero() && r.unservedSince.Before(t0) {
		r.unservedSince = time.Time{}
	}
}

// servedSince is the start of the first round that saw a ztunnel serve
// after the restart action at start (zero: none yet).
func (r *recorder) servedSince(start time.Time) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.servedAfter[start]
}

// unserved is when the soak killed every ztunnel, zero if one served since.
func (r *recorder) unserved() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.unservedSince
}

// quiet: how long no fault has been in flight at t (0 while one is), when
// the current recovery window began, and whether it is still open.
func (r *recorder) quiet(t time.Time) (time.Duration, time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.inFlight > 0 {
		return 0, r.lastFaultEnd, false
	}
	last := r.lastFaultEnd
	for _, f := range r.faults {
		if f.End.After(last) {
			last = f.End
		}
	}
	return t.Sub(last), r.lastFaultEnd, r.windowOpen
}

func (r *recorder) recovered(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.windowOpen {
		r.recoveries = append(r.recoveries, t.Sub(r.lastFaultEnd))
		r.windowOpen = false
	}
}

func (r *recorder) violation(v violation) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var lastEnd time.Time
	for _, f := range r.faults {
		if !f.Start.After(v.At) && (!f.done || f.End.After(v.At)) {
			v.InFlight = append(v.InFlight, f.Kind+" "+f.Detail)
		} else if f.done && f.End.Before(v.At) && f.End.After(lastEnd) {
			lastEnd, v.LastEnd = f.End, f.Kind+" ended "+v.At.Sub(f.End).Round(time.Millisecond).String()+" before"
		}
	}
	r.violations = append(r.violations, v)
}

func (r *recorder) round(t time.Time, counts [numStates]int, bypassing int, served bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rounds = append(r.rounds, round{At: t.Sub(r.start), Counts: counts, Bypassing: bypassing, Served: served})
}

func (r *recorder) gap(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.gaps = append(r.gaps, d)
}

func (r *recorder) snapshotViolations() []violation {
	r.mu.Lock()
	defer r.mu.Unlock()
	v := slices.Clone(r.violations)
	slices.SortStableFunc(v, func(a, b violation) int { return a.At.Compare(b.At) })
	return v
}

func (r *recorder) window(kind string, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.windows[kind] = append(r.windows[kind], d)
}
