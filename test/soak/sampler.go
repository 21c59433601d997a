package main

import (
	"context"
	"fmt"
	"maps"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/podmeta"
)

// The sampler's bounds.
const (
	// probeTimeout bounds one probe connection (dial + the answer line).
	probeTimeout = time.Second
	// roundEvery is the sampler's period: every live pod is probed each
	// round, so each is sampled about this often (the summary reports the
	// real gaps).
	roundEvery = 400 * time.Millisecond
	// blackHoleBound: how long a pod may be captured with nothing
	// answering while a ztunnel is connected with its snapshot — an Add
	// round trip (informer event → rules → Add → ack) on a loaded 2-core
	// machine.
	blackHoleBound = 3 * time.Second
	// lostBound: how long after the last fault ended (and after the pod's
	// own last change) a pod may be out of its policy state.
	lostBound = 15 * time.Second
	// restoredBound and restoredSlack: a pod whose rules were wiped while
	// the agent was down may be claimed enrolled with its traffic direct
	// until the later of restoredBound after the soak's action that starts
	// the agent again and restoredSlack after the first sampler round that
	// saw a ztunnel serve since (the emulator's own state: it had the new
	// agent's snapshot). The agent verifies and repairs every pod it
	// restores while it starts, before it takes a ztunnel's connection,
	// and well before its first drift pass. One that left the repair to
	// that pass (5 s after its start, at the soak's period) leaves a run
	// past both: the ztunnel reconnects within 2 s of the agent listening
	// (the emulator's back-off), and 4.5 s is a round short of 5 s.
	restoredBound = 4500 * time.Millisecond
	restoredSlack = 2 * time.Second
	// unservedSlack: how long past the agent's ztunnel grace a pod may
	// stay Ready (enrolled condition True) while no ztunnel serves the
	// node: the agent's status writes for every enabled pod and the
	// sampler's claims read (every 200 ms).
	unservedSlack = 2 * time.Second
)

// unservedBound is how long after the soak killed every ztunnel no pod may
// be Ready in the mesh: the agent's --ztunnel-grace in the soak's agent
// flags (the last one), plus unservedSlack. A grace of 0 (never) is the
// agent switched off its promise: the soak still holds it to the default.
func unservedBound(c config) time.Duration {
	grace := agent.DefaultZtunnelGrace
	if v, ok := agentFlag(c, "ztunnel-grace"); ok {
		if d, err := time.ParseDuration(v); err == nil && d > 0 {
			grace = d
		}
	}
	return grace + unservedSlack
}

// agentFlag is the value of the last --name in the soak's agent flags
// (--name=v, --name v, or a bare --name: "true").
func agentFlag(c config, name string) (string, bool) {
	var val string
	var found bool
	for i, a := range c.agentArgs {
		a = strings.TrimLeft(a, "-")
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			val, found = v, true
		} else if a == name {
			val, found = "true", true
			if i+1 < len(c.agentArgs) && !strings.HasPrefix(c.agentArgs[i+1], "-") {
				val = c.agentArgs[i+1]
			}
		}
	}
	return val, found
}

// bypassBound is how long a pod may be claimed enrolled while its traffic
// reaches the app directly: a wipe is only seen by the drift pass, so one
// drift period (jittered +10%) plus the repair and a sampler round. With
// the drift pass off (the test that proves the sampler) the bound is the
// default soak period's, so a wipe that is never repaired is caught.
func bypassBound(c config) time.Duration {
	v := max(c.verifyInterval, 5*time.Second)
	return v + v/10 + 3*time.Second
}

// outcome is what one probe connection found.
type outcome int

const (
	outDead    outcome = iota // refused, reset, timed out: captured with nothing behind, or broken
	outProxy                  // the ztunnel emulator answered, for this pod's uid
	outDirect                 // the app (inbound) or the remote (outbound) answered: not captured
	outForeign                // the emulator answered for another uid, or garbage
	outSidecar                // a sidecar-mode pod's own proxy answered
)

func (o outcome) String() string {
	return [...]string{"dead", "proxy", "direct", "foreign", "sidecar"}[o]
}

// state is a pod's sample: both directions together.
type state int32

const (
	stMeshed    state = iota // both directions reached the proxy
	stPlain                  // both reached the app / remote directly
	stBlackHole              // a direction went nowhere, none reached the app
	stPartial                // one direction direct, the other not
	stForeign                // someone else's proxy
	stSidecar                // both directions reached the pod's own (sidecar) proxy
	numStates
)

func (s state) String() string {
	return [...]string{"meshed", "plain", "black hole", "partial", "foreign proxy", "sidecar"}[s]
}

// classify reads one probe's answer: direct is what the far end answers,
// own what the pod's own proxy answers ("" for a pod without one).
func classify(line string, err error, uid, direct, own string) outcome {
	switch {
	case err != nil:
		return outDead
	case strings.HasPrefix(line, "ztunnel-emulator uid="+uid+" "):
		return outProxy
	case line == direct:
		return outDirect
	case own != "" && line == own:
		return outSidecar
	default:
		return outForeign
	}
}

func combine(out, in outcome) state {
	switch {
	case out == outProxy && in == outProxy:
		return stMeshed
	case out == outSidecar && in == outSidecar:
		return stSidecar
	case out == outDirect && in == outDirect:
		return stPlain
	case out == outDirect || in == outDirect:
		return stPartial
	case out == outForeign || in == outForeign:
		return stForeign
	default:
		return stBlackHole
	}
}

// judgeState is the sampler's memory of one pod.
type judgeState struct {
	last         time.Time
	bypass, dead badRun
	// restored: the run of a pod wiped while the agent was down, claimed
	// enrolled with its traffic direct after the soak started it again.
	restored badRun
	// unservedR: the ztunnel outage (its start) for which the pod's
	// ready-while-unserved violation was reported.
	unservedR time.Time
	// dnsBypass: the run of an ambient pod claimed enrolled whose DNS
	// query was answered by the nameserver itself, not its ztunnel.
	dnsBypass badRun
	lostR     bool
	sidecarR  bool         // a sidecar pod's violation reported
	lastState atomic.Int32 // state+1; 0 = never sampled
}

// badRun is a run of consecutive samples in one bad condition.
type badRun struct {
	since    time.Time
	reported bool
}

// observe adds a sample (bad or not) at t: it returns how long the run has
// lasted and true the first time that reaches bound; a run that ends is
// recorded as a window of kind.
func (b *badRun) observe(rec *recorder, kind string, bad bool, t time.Time, bound time.Duration) (time.Duration, bool) {
	if !bad {
		if !b.since.IsZero() {
			rec.window(kind, t.Sub(b.since))
		}
		*b = badRun{}
		return 0, false
	}
	if b.since.IsZero() {
		b.since = t
	}
	d := t.Sub(b.since)
	if d >= bound && !b.reported {
		b.reported = true
		return d, true
	}
	return d, false
}

type sample struct {
	r       *podRec
	at      time.Time
	out, in outcome
	// dns is the answer to a DNS query (an ambient pod's only: a sidecar
	// pod's DNS is its own proxy's business); dnsOK: one was made.
	dns   outcome
	dnsOK bool
	ok    bool // false: the pod went away, or is in a churn operation
	busy  bool // in a churn operation (sandbox being made, being deleted)
}

// sample runs rounds until ctx ends: the API's claims, the emulators' view,
// a probe each way for every pod, then the judgement.
func (s *soak) sample(ctx context.Context) {
	go s.claimsLoop(ctx)
	for ctx.Err() == nil {
		t0 := time.Now()
		served0, held := s.node.view(ctx)
		claims, claimsAt, claimsOK := s.freshClaims()
		pods := s.alive()
		results := make([]sample, len(pods))
		var wg sync.WaitGroup
		sem := make(chan struct{}, 8)
		for i, r := range pods {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				results[i] = s.probe(ctx, r)
			})
		}
		wg.Wait()
		if ctx.Err() != nil {
			return
		}
		served1, held1 := s.node.view(ctx)
		maps.Copy(held, held1)
		if served0 && served1 {
			s.rec.ztunnelServed(t0)
		}
		// Unserved: neither read saw a ztunnel serve, so none served when
		// the claims were read (between the two).
		var unservedFor time.Duration
		if since := s.rec.unserved(); !served0 && !served1 && !since.IsZero() && claimsOK {
			unservedFor = claimsAt.Sub(since)
		}
		s.judge(t0, results, claims, claimsOK, served0 && served1, held, unservedFor)
		select {
		case <-ctx.Done():
		case <-time.After(time.Until(t0.Add(roundEvery))):
		}
	}
}

// claimsLoop keeps the latest claims read from the API, every 200 ms, in
// its own goroutine: a frozen API server must not stall the rounds.
func (s *soak) claimsLoop(ctx context.Context) {
	for ctx.Err() == nil {
		if c, ok := s.claims(ctx); ok {
			s.claimMu.Lock()
			s.lastClaims, s.claimsAt = c, time.Now()
			s.claimMu.Unlock()
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// freshClaims are the latest claims and when they were read, if that was
// within the last second; ok is false otherwise (the API is not
// answering): then nothing is judged on claims this round.
func (s *soak) freshClaims() (map[string]claim, time.Time, bool) {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if time.Since(s.claimsAt) > time.Second {
		return nil, time.Time{}, false
	}
	return s.lastClaims, s.claimsAt, true
}

// claim is what a pod says of itself in the API.
type claim struct {
	annotation bool // ambient.istio.io/redirection: enabled
	condition  bool // ambient.istio.io/enrolled True
	notInMesh  bool // ... with reason NotInMesh: Ready because out of the mesh
}

// enrolled: the pod claims to be in the mesh — the annotation says
// enabled, or the condition is True for any reason but NotInMesh; True
// with NotInMesh (the agent took the pod out of the mesh on purpose, so a
// gated pod can be Ready) is a claim of enrollment only when the pod
// belongs in the mesh by policy (wantMesh): then it is Ready uncaptured.
func (c claim) enrolled(wantMesh bool) bool {
	return c.annotation || (c.condition && (!c.notInMesh || wantMesh))
}

// claims reads, from the API, what every pod claims; ok is false when the
// API did not answer.
func (s *soak) claims(ctx context.Context) (map[string]claim, bool) {
	ctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	list, err := s.env.CP.Admin.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, false
	}
	out := map[string]claim{}
	for _, p := range list.Items {
		c := claim{annotation: p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled}
		for _, pc := range p.Status.Conditions {
			if pc.Type == podmeta.ConditionEnrolled && pc.Status == corev1.ConditionTrue {
				c.condition, c.notInMesh = true, pc.Reason == agent.ReasonNotInMesh
			}
		}
		out[string(p.UID)] = c
	}
	return out, true
}

// probe dials out of the pod (to the prober) and into it (from the
// prober), each one connection from inside a network namespace.
func (s *soak) probe(ctx context.Context, r *podRec) sample {
	// A pod whose sandbox is being made or torn down is not sampled this
	// round (waiting for it would stall the round).
	if !r.mu.TryRLock() {
		return sample{r: r, busy: true}
	}
	defer r.mu.RUnlock()
	if r.deleted {
		return sample{r: r}
	}
	at := time.Now()
	own := ""
	if r.sidecar {
		own = sidecarAnswerPrefix + r.name
	}
	line, err := readLine(ctx, func(ctx context.Context) (net.Conn, error) { return r.p.Dial(ctx, "tcp", s.proberIP) })
	out := classify(line, err, r.uid, "remote", own)
	line, err = readLine(ctx, func(ctx context.Context) (net.Conn, error) {
		return s.prober.Dial(ctx, "tcp", netIPPort(r.p.IP().String(), appPort))
	})
	in := classify(line, err, r.uid, "app "+r.name, own)
	x := sample{r: r, at: at, out: out, in: in, ok: true}
	if !r.sidecar {
		line, err = queryLine(ctx, func(ctx context.Context) (net.Conn, error) { return r.p.Dial(ctx, "udp", s.proberDNS) })
		x.dns, x.dnsOK = classify(line, err, r.uid, nameserverAnswer, ""), true
		s.dnsAnswers[x.dns].Add(1)
	}
	return x
}

// queryLine sends one datagram on a connection dial makes (a DNS query
// through the pod's resolver: UDP to its nameserver's port 53) and reads
// the line that answers it.
func queryLine(ctx context.Context, dial func(context.Context) (net.Conn, error)) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	c, err := dial(ctx)
	if err != nil {
		return "", err
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	if _, err := c.Write([]byte("soak query")); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(buf[:n])), nil
}

// judge judges a round's samples: claims are the API's (claimsOK: fresh),
// served whether a ztunnel served the node through the round, held the
// uids the ztunnel emulators held workloads for, unservedFor how long
// before the claims were read the soak had killed every ztunnel, none
// serving since (0: a ztunnel served, or the soak made no outage).
func (s *soak) judge(t0 time.Time, results []sample, claims map[string]claim, claimsOK, served bool, held map[string]bool, unservedFor time.Duration) {
	bound := bypassBound(s.cfg)
	uBound, outage := unservedBound(s.cfg), s.rec.unserved()
	var counts [numStates]int
	bypassing := 0
	quietFor, windowStart, pendingRecovery := s.rec.quiet(t0)
	allInPolicy := true
	var outOfPolicy []string // pods keeping the storm's recovery open
	// Per fault: recovered once every pod unchanged since before its end
	// is in its policy state (pods not sampled this round do not count).
	faultEnds := s.rec.pendingRecoveries()
	for id, end := range faultEnds {
		if !end.Before(t0) {
			delete(faultEnds, id) // ended during this round: judged from the next
		}
	}
	for _, x := range results {
		if x.busy {
			// The gap across a churn operation is not a sampling gap.
			x.r.judge.last = time.Time{}
		}
		if !x.ok {
			continue
		}
		r, j := x.r, &x.r.judge
		st := combine(x.out, x.in)
		counts[st]++
		s.rec.samples.Add(1)
		if !j.last.IsZero() {
			s.rec.gap(x.at.Sub(j.last))
		}
		j.last = x.at
		j.lastState.Store(int32(st) + 1)
		pod := r.ns.name + "/" + r.name

		s.mu.Lock()
		observeSidecar(r, st)
		want, since, policy := wantMesh(r), stable(r), policyState(r)
		s.mu.Unlock()
		direct := x.out == outDirect || x.in == outDirect
		claimed := claimsOK && claims[r.uid].enrolled(want)
		if r.sidecar && !j.sidecarR {
			// Never in ambient, whatever its labels: never claimed (not
			// even True/NotInMesh), never a ztunnel's workload, never
			// answered for by a ztunnel.
			c := claims[r.uid]
			var why string
			switch {
			case claimsOK && (c.annotation || c.condition):
				why = fmt.Sprintf("claims ambient (annotation enabled %v, enrolled condition True %v)", c.annotation, c.condition)
			case held[r.uid]:
				why = "a ztunnel holds it as a workload"
			case x.out == outProxy || x.in == outProxy:
				why = fmt.Sprintf("a ztunnel answered for it (out=%s in=%s)", x.out, x.in)
			}
			if why != "" {
				j.sidecarR = true
				s.rec.violation(violation{At: x.at, Kind: kindSidecar, Pod: pod, UID: r.uid, Detail: why})
			}
		}
		s.judgeRestored(x, pod, claimed, claimsOK, since)
		if claimed && direct {
			bypassing++
		}
		if r.wiping.Load() || s.rec.agentOutAt(x.at) {
			// Judged from the end of the wipe, or from the soak's action
			// that starts the agent again (none can correct a claim
			// before). A pod made while the agent starts is judged from
			// its first sample.
			j.bypass, j.dnsBypass = badRun{}, badRun{}
		} else {
			if d, report := j.bypass.observe(s.rec, kindBypass, claimed && direct, x.at, bound); report {
				s.rec.violation(violation{At: j.bypass.since, Kind: kindBypass, Pod: pod, UID: r.uid,
					Detail: fmt.Sprintf("claimed enrolled while out=%s in=%s for %v (bound %v)", x.out, x.in, d.Round(time.Millisecond), bound)})
			}
			// The agent captures DNS by default: the soak holds it to
			// that (--dns-capture=false is a known-bad flag here).
			dnsDirect := x.dnsOK && x.dns == outDirect
			if d, report := j.dnsBypass.observe(s.rec, kindDNSBypass, claimed && dnsDirect, x.at, bound); report {
				s.rec.violation(violation{At: j.dnsBypass.since, Kind: kindDNSBypass, Pod: pod, UID: r.uid,
					Detail: fmt.Sprintf("claimed enrolled while its DNS query was answered by the nameserver itself for %v (bound %v)", d.Round(time.Millisecond), bound)})
			}
		}
		if c := claims[r.uid]; unservedFor > uBound && c.condition && !c.notInMesh && !j.unservedR.Equal(outage) {
			j.unservedR = outage
			s.rec.violation(violation{At: outage.Add(uBound), Kind: kindUnservedReady, Pod: pod, UID: r.uid,
				Detail: fmt.Sprintf("enrolled condition True %v after the soak killed every ztunnel, none serving since (bound: grace + %v = %v)",
					unservedFor.Round(time.Millisecond), unservedSlack, uBound)})
		}
		dead := (x.out == outDead || x.in == outDead) && !direct
		if d, report := j.dead.observe(s.rec, kindBlackHole, served && dead, x.at, blackHoleBound); report {
			s.rec.violation(violation{At: j.dead.since, Kind: kindBlackHole, Pod: pod, UID: r.uid,
				Detail: fmt.Sprintf("out=%s in=%s with a ztunnel serving for %v (bound %v)", x.out, x.in, d.Round(time.Millisecond), blackHoleBound)})
		}

		if st == policy {
			j.lostR = false
		} else {
			if since.Before(windowStart) {
				allInPolicy = false
				outOfPolicy = append(outOfPolicy, fmt.Sprintf("%s (policy %s, sampled out=%s in=%s, unchanged for %v)", pod, policy, x.out, x.in, x.at.Sub(since).Round(time.Millisecond)))
			}
			for id, end := range faultEnds {
				if since.Before(end) {
					delete(faultEnds, id)
				}
			}
			if quietFor >= lostBound && x.at.Sub(since) >= lostBound && !j.lostR {
				j.lostR = true
				s.rec.violation(violation{At: x.at, Kind: kindLost, Pod: pod, UID: r.uid,
					Detail: fmt.Sprintf("policy %s, sampled %s (out=%s in=%s) %v after the last fault and %v after its last change", policy, st, x.out, x.in,
						quietFor.Round(time.Millisecond), x.at.Sub(since).Round(time.Millisecond))})
			}
		}
	}
	if pendingRecovery && allInPolicy {
		s.rec.recovered(t0)
	}
	// A slow recovery says which pods it waits for (once per storm, 5 s
	// after its end): the log keeps what the summary's figure hides.
	if pendingRecovery && !allInPolicy && t0.Sub(windowStart) > 5*time.Second && s.slowLogged != windowStart {
		s.slowLogged = windowStart
		s.logf("recovery from the storm that ended %v ago still waits for: %s", t0.Sub(windowStart).Round(time.Millisecond), strings.Join(outOfPolicy, "; "))
	}
	for id := range faultEnds {
		s.rec.faultRecovered(id, t0)
	}
	s.rec.round(t0, counts, bypassing, served)
}

// judgeRestored judges a pod whose rules were wiped while the agent was
// down, unchanged since: from the soak's action that starts the agent
// again it must not be claimed enrolled while a direction is direct (the
// restart verifies it) for longer than restoredBound, counted from that
// action; the first sample that is not ends the watch. Rounds without
// fresh claims judge nothing here (and end nothing).
func (s *soak) judgeRestored(x sample, pod string, claimed, claimsOK bool, since time.Time) {
	r, j := x.r, &x.r.judge
	s.mu.Lock()
	downWiped, started := r.downWipedAt, r.downWipeStartAt
	s.mu.Unlock()
	if downWiped.IsZero() || started.IsZero() || !x.at.After(started) || !since.Before(downWiped) || r.wiping.Load() {
		j.restored = badRun{}
		return
	}
	if !claimsOK {
		return
	}
	bad := claimed && (x.out == outDirect || x.in == outDirect)
	if bad && j.restored.since.IsZero() {
		// The clock is the restart action, not the first sample after it.
		j.restored.since = started
	}
	// Until a ztunnel served the new agent, only the restart clock runs
	// and it does not end (the agent may still be starting).
	bound, served := time.Duration(1<<62), s.rec.servedSince(started)
	if !served.IsZero() {
		bound = max(restoredBound, served.Add(restoredSlack).Sub(started))
	}
	if d, report := j.restored.observe(s.rec, kindRestored, bad, x.at, bound); report {
		s.downWipesSeen.Add(1)
		s.rec.violation(violation{At: j.restored.since, Kind: kindRestored, Pod: pod, UID: r.uid,
			Detail: fmt.Sprintf("rules wiped while the agent was down; claimed enrolled while out=%s in=%s for %v after the soak started the agent again, %v after a ztunnel served it (bound: the later of %v and %v)",
				x.out, x.in, d.Round(time.Millisecond), x.at.Sub(served).Round(time.Millisecond), restoredBound, restoredSlack)})
	}
	if !bad {
		s.mu.Lock()
		if r.downWipedAt.Equal(downWiped) {
			r.downWipedAt = time.Time{}
			if !j.restored.reported {
				s.downWipesSeen.Add(1)
			}
		}
		s.mu.Unlock()
	}
}

// waitAllInPolicy waits until the sampler saw every pod in its policy state
// (or ctx ends).
func (s *soak) waitAllInPolicy(ctx context.Context) {
	for ctx.Err() == nil {
		all := true
		for _, r := range s.alive() {
			s.mu.Lock()
			policy := policyState(r)
			s.mu.Unlock()
			if r.judge.lastState.Load() != int32(policy)+1 {
				all = false
			}
		}
		if all {
			// One more round, so pods are judged after the change too.
			time.Sleep(2 * roundEvery)
			return
		}
		time.Sleep(roundEvery)
	}
}
