package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"syscall"
	"time"
)

// A fault acts on the node and undoes itself (or lets the agent undo it);
// it returns a short description of what it did.
type fault func(ctx context.Context, s *soak, rng *rand.Rand) (string, error)

// lane: process faults run one at a time (lane 0); state faults (lane 1)
// run beside them. settle, when set, is what the lane waits for after the
// fault ended and before its next one: pacing only, never a verdict's
// clock.
type faultKind struct {
	lane   int
	run    fault
	settle func(ctx context.Context, s *soak) error
}

var faultKinds = map[string]faultKind{
	"agent-kill":             {0, agentKill, agentSettle},
	"agent-term":             {0, agentTerm, agentSettle},
	"ztunnel-kill":           {0, ztunnelKill, nil},
	"ztunnel-handover":       {0, ztunnelHandover, nil},
	"apiserver-stop":         {0, apiserverStop, nil},
	"pod-rules-wiped":        {1, podRulesWiped, nil},
	"host-rules-deleted":     {1, hostRulesDeleted, nil},
	"owned-conflist-deleted": {1, ownedConflistDeleted, nil},
	"primary-rewritten":      {1, primaryRewritten, nil},
}

func allFaultKinds() []string {
	var out []string
	for k := range faultKinds {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// Storms of faults alternate with quiet windows, in which the lost-pod
// check judges (a pod must reach its policy state within lostBound of the
// last fault's end).
const (
	stormLength = 30 * time.Second
	quietLength = lostBound + 8*time.Second
)

// injectFaults runs storms and quiet windows until ctx ends. In a storm,
// each lane runs its faults back to back with short random gaps.
func (s *soak) injectFaults(ctx context.Context) {
	if len(s.cfg.faults) == 0 {
		return
	}
	var lanes [2][]string
	for _, k := range s.cfg.faults {
		lanes[faultKinds[k].lane] = append(lanes[faultKinds[k].lane], k)
	}
	seeds := [2]uint64{s.frng.Uint64(), s.frng.Uint64()}
	for storm := uint64(0); ctx.Err() == nil; storm++ {
		stormEnd := time.Now().Add(stormLength)
		var wg sync.WaitGroup
		for i, kinds := range lanes {
			if len(kinds) == 0 {
				continue
			}
			rng := rand.New(rand.NewPCG(seeds[i], storm))
			wg.Go(func() { s.lane(ctx, stormEnd, kinds, rng) })
		}
		wg.Wait()
		s.rec.faultEnded(time.Now())
		select {
		case <-ctx.Done():
			return
		case <-time.After(quietLength):
		}
	}
}

func (s *soak) lane(ctx context.Context, until time.Time, kinds []string, rng *rand.Rand) {
	for ctx.Err() == nil && time.Now().Before(until) {
		kind := kinds[rng.IntN(len(kinds))]
		id := s.rec.faultStarted(kind)
		// A fault always finishes (its undo must run), even past the end.
		fctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		detail, err := faultKinds[kind].run(fctx, s, rng)
		cancel()
		s.rec.faultFinished(id, detail, err)
		if err != nil {
			s.logf("fault %s: %v", kind, err)
		}
		if settle := faultKinds[kind].settle; settle != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			if err := settle(sctx, s); err != nil {
				s.logf("after fault %s: %v", kind, err)
			}
			cancel()
		}
		gap := time.Duration(300+rng.IntN(1700)) * time.Millisecond
		select {
		case <-ctx.Done():
		case <-time.After(gap):
		}
	}
}

func jitter(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(rng.Int64N(int64(hi-lo)))
}

// agentKill: SIGKILL (a crash, an OOM kill), down a while, started again;
// the fault lasts until the soak starts the new agent (the lane then waits
// for it to be ready before its next fault). While it is down a resident
// pod's rules are wiped (wipeWhileDown). About one kill in five keeps the
// agent down for 8–20 s: longer than the ztunnel grace and any bound the
// sampler has, so pods made meanwhile meet the plugin without an agent.
func agentKill(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	a := s.node.agent
	s.rec.agentSignalled(time.Now())
	if err := a.Kill(); err != nil {
		return "", err
	}
	s.rec.agentExited(time.Now())
	wiped, err := s.wipeWhileDown(rng)
	if err != nil {
		return "", err
	}
	down := jitter(rng, 200*time.Millisecond, 3*time.Second)
	if rng.IntN(5) == 0 {
		down = jitter(rng, 8*time.Second, 20*time.Second)
	}
	time.Sleep(down)
	if err := s.startAgent(wiped); err != nil {
		return "", err
	}
	return fmt.Sprintf("down %v, wiped %s", down.Round(time.Millisecond), wiped.nameOr()), nil
}

// agentTerm: SIGTERM (the upgrade path: the agent shuts down as a
// DaemonSet rollout stops it), the new one started at once (after a
// resident pod's rules are wiped: wipeWhileDown).
func agentTerm(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	a := s.node.agent
	s.rec.agentSignalled(time.Now())
	if err := a.Stop(30 * time.Second); err != nil {
		return "", err
	}
	s.rec.agentExited(time.Now())
	wiped, err := s.wipeWhileDown(rng)
	if err != nil {
		return "", err
	}
	return "wiped " + wiped.nameOr(), s.startAgent(wiped)
}

// agentSettle: the lane's next fault waits for the restarted agent to be
// ready (pacing: the verdicts' clocks are the soak's own actions).
func agentSettle(ctx context.Context, s *soak) error { return s.node.waitAgentReady(ctx) }

// startAgent starts the agent again and records the action, the clock the
// sampler judges the restart from: from here the pod wiped while it was
// down must be back in order soon (judgeRestored), and every claim within
// the bypass bound.
func (s *soak) startAgent(wiped *podRec) error {
	at := time.Now()
	s.rec.agentStarting(at)
	if wiped != nil {
		s.mu.Lock()
		wiped.downWipeStartAt = at
		s.mu.Unlock()
	}
	return s.node.agent.Start()
}

// wipeWhileDown flushes the rules of a random resident pod while no agent
// runs (a runtime or a NET_ADMIN container flushing them then): only the
// restarted agent's verification of the pods it restores can find it
// before it is ready; its drift pass comes a period later.
func (s *soak) wipeWhileDown(rng *rand.Rand) (*podRec, error) {
	var res []*podRec
	for _, r := range s.alive() {
		if r.resident {
			res = append(res, r)
		}
	}
	if len(res) == 0 {
		return nil, nil
	}
	r := res[rng.IntN(len(res))]
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.deleted {
		return nil, nil
	}
	if err := wipePodRules(r.p); err != nil {
		return nil, fmt.Errorf("wiping %s while the agent is down: %w", r.name, err)
	}
	s.mu.Lock()
	r.downWipedAt, r.downWipeStartAt = time.Now(), time.Time{}
	s.mu.Unlock()
	s.downWipes.Add(1)
	return r, nil
}

func (r *podRec) nameOr() string {
	if r == nil {
		return "none"
	}
	return r.name
}

// ztunnelKill: the ztunnel emulator SIGKILLed (its listeners go with it),
// a new one started after a while; the fault lasts until it serves.
func ztunnelKill(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	for _, em := range s.node.emulators() {
		if err := em.Kill(); err != nil {
			return "", err
		}
		s.node.dropEmulator(em)
	}
	// The sampler's clock of the outage (ready while unserved).
	s.rec.ztunnelsKilled(time.Now())
	// Half the outages outlast the agent's grace (5 s by default) and the
	// sampler's slack on top.
	down := jitter(rng, 200*time.Millisecond, 16*time.Second)
	time.Sleep(down)
	if _, err := s.node.startEmulator(ctx); err != nil {
		return "", err
	}
	return fmt.Sprintf("down %v", down.Round(time.Millisecond)), s.node.waitServed(ctx, 60*time.Second)
}

// ztunnelHandover: a second ztunnel connects (a rolling upgrade), and once
// it serves the first leaves (SIGTERM): the agent must move the pods the
// first held to the second.
func ztunnelHandover(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	old := s.node.emulators()
	em, err := s.node.startEmulator(ctx)
	if err != nil {
		return "", err
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		if _, ok := emuServing(wctx, em); ok {
			break
		}
		select {
		case <-wctx.Done():
			return "", fmt.Errorf("second ztunnel never got its snapshot")
		case <-time.After(100 * time.Millisecond):
		}
	}
	both := jitter(rng, 0, 3*time.Second)
	time.Sleep(both)
	for _, o := range old {
		if err := o.Stop(10 * time.Second); err != nil {
			return "", err
		}
		s.node.dropEmulator(o)
	}
	return fmt.Sprintf("both served %v", both.Round(time.Millisecond)), nil
}

// apiserverStop freezes kube-apiserver (SIGSTOP) for up to 20 s: every
// watch and request stalls, then it resumes (SIGCONT).
func apiserverStop(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	api := s.env.CP.APIServer
	if err := api.Signal(syscall.SIGSTOP); err != nil {
		return "", err
	}
	frozen := jitter(rng, 2*time.Second, 20*time.Second)
	time.Sleep(frozen)
	if err := api.Signal(syscall.SIGCONT); err != nil {
		return "", err
	}
	return fmt.Sprintf("frozen %v", frozen.Round(time.Millisecond)), s.env.CP.WaitReady(ctx)
}

// podRulesWiped removes the rules of a random live ambient pod (a
// NET_ADMIN container or a runtime): two times in three all of them
// (wipePodRules: every iptables table flushed, the native tables deleted),
// else the one rule that jumps to a direction's capture chain
// (dropPodJump). The agent's drift pass must repair them.
func podRulesWiped(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	var cands []*podRec
	s.mu.Lock()
	for _, r := range s.pods {
		if wantMesh(r) {
			cands = append(cands, r)
		}
	}
	s.mu.Unlock()
	if len(cands) == 0 {
		return "no ambient pod", nil
	}
	slices.SortFunc(cands, func(a, b *podRec) int { return a.id - b.id })
	r := cands[rng.IntN(len(cands))]
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.deleted {
		return r.name + " (deleted meanwhile)", nil
	}
	r.wiping.Store(true)
	defer r.wiping.Store(false)
	s.mu.Lock()
	r.downWipedAt = time.Time{} // judged as a wipe under a running agent from now on
	s.mu.Unlock()
	if rng.IntN(3) == 0 {
		what, err := dropPodJump(r.p, rng)
		return r.ns.name + "/" + r.name + ": " + what, err
	}
	return r.ns.name + "/" + r.name + ": all", wipePodRules(r.p)
}

// hostRulesDeleted removes the node's probe SNAT, as a firewall reload
// does (deleteHostRules); the drift pass must put it back.
func hostRulesDeleted(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	return deleteHostRules(ctx, rng)
}
