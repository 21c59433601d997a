package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// result is everything the summary and the timeline show.
type result struct {
	cfg          config
	machineStart string
	machineEnd   string
	rec          *recorder
	baseline     usage
	settled      time.Time
	leaks        []leakCheck
	created      int64
	deleted      int64
	// sidecars: sidecar-mode pods made; downWipes: resident pods wiped
	// while the agent was down, downWipesSeen: judged after its restart.
	sidecars, downWipes, downWipesSeen int64
	// absentAdds: ADDs through our plugin while no agent ran, the API up,
	// by [in the mesh][started] (soak.countAbsent).
	absentAdds   [2][2]int64
	plainPastTTL int64
	ops          map[string]*opCount
	agentLog     string
	violations   []violation
}

func (r *result) violationCount() int { return len(r.violations) }

func (r *result) faultCount() int {
	r.rec.mu.Lock()
	defer r.rec.mu.Unlock()
	return len(r.rec.faults)
}

func (r *result) lastLine() string {
	return fmt.Sprintf("soak: %d pods, %d faults, %d samples, %d violations", r.created, r.faultCount(), r.rec.samples.Load(), r.violationCount())
}

// attachLogs takes the violations from the recorder and gives each the
// agent's log lines about its pod around its time (or, for violations of
// no pod, the lines around its time).
func (r *result) attachLogs() {
	r.violations = r.rec.snapshotViolations()
	type line struct {
		at   time.Time
		text string
	}
	var lines []line
	if f, err := os.Open(r.agentLog); err == nil {
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			t := sc.Text()
			// The agent logs JSON lines (docs/agent.md, "Logging").
			var rec struct {
				Time time.Time `json:"time"`
			}
			if json.Unmarshal([]byte(t), &rec) != nil || rec.Time.IsZero() {
				continue
			}
			at := rec.Time
			lines = append(lines, line{at, t})
		}
		f.Close()
	}
	bound := bypassBound(r.cfg)
	for i := range r.violations {
		v := &r.violations[i]
		from, to := v.At.Add(-10*time.Second), v.At.Add(bound+5*time.Second)
		name := v.Pod
		if _, n, ok := strings.Cut(v.Pod, "/"); ok {
			name = n
		}
		var hits []string
		for _, l := range lines {
			if l.at.Before(from) || l.at.After(to) {
				continue
			}
			if v.Pod == "" || strings.Contains(l.text, v.UID) || strings.Contains(l.text, name) {
				hits = append(hits, l.text)
			}
		}
		if len(hits) > 12 {
			hits = append(hits[:6], append([]string{fmt.Sprintf("... (%d lines)", len(hits)-12)}, hits[len(hits)-6:]...)...)
		}
		v.Log = hits
	}
}

func (r *result) summary() string {
	var b strings.Builder
	rec := r.rec
	rec.mu.Lock()
	defer rec.mu.Unlock()
	fmt.Fprintf(&b, "\n== soak summary (seed %d) ==\n", r.cfg.seed)
	fmt.Fprintf(&b, "machine: %s; load average at the end %s\n", r.machineStart, r.machineEnd)
	fmt.Fprintf(&b, "duration: %v of churn and faults, settled %v after the start; about %d pods alive at once\n",
		r.cfg.duration, r.settled.Sub(rec.start).Round(time.Second), r.cfg.pods)
	bin := "bin/ambientd"
	if r.cfg.agentBin != "" {
		bin = r.cfg.agentBin
	}
	fmt.Fprintf(&b, "agent: %s --verify-interval=%v %s\n", bin, r.cfg.verifyInterval, strings.Join(r.cfg.agentArgs, " "))
	plugin := "bin/ambientd-cni"
	if r.cfg.pluginBin != "" {
		plugin = r.cfg.pluginBin
	}
	fmt.Fprintf(&b, "install: --install-cni (owned conflist) of %s, lease TTL %v\n", plugin, r.cfg.leaseTTLOr())
	fmt.Fprintf(&b, "bounds: bypass %v, black hole while served %v, lost pod %v after the last fault\n", bypassBound(r.cfg), blackHoleBound, lostBound)
	fmt.Fprintf(&b, "pods: %d created (%d of them sidecar-mode, %d resident), %d deleted\n", r.created, r.sidecars, residentPods, r.deleted)
	fmt.Fprintf(&b, "rules wiped while the agent was down (agent-kill, agent-term): %d; judged after the restarted agent was ready (seen back in order, or reported): %d\n", r.downWipes, r.downWipesSeen)
	fmt.Fprintf(&b, "ADDs through our plugin while no agent ran, the API up: outside the mesh %d started (%d with the lease past its TTL), %d refused; in the mesh %d waited, %d started\n",
		r.absentAdds[0][1], r.plainPastTTL, r.absentAdds[0][0], r.absentAdds[1][0], r.absentAdds[1][1])
	b.WriteString("churn operations (ok / failed):")
	for _, k := range sortedKeys(r.ops) {
		fmt.Fprintf(&b, " %s %d/%d;", k, r.ops[k].ok, r.ops[k].failed)
	}
	b.WriteString("\n")

	byKind := map[string][]faultRec{}
	for _, f := range rec.faults {
		byKind[f.Kind] = append(byKind[f.Kind], f)
	}
	recByKind := map[string][]time.Duration{}
	var allRec []time.Duration
	for id, d := range rec.recovery {
		recByKind[rec.faults[id].Kind] = append(recByKind[rec.faults[id].Kind], d)
		allRec = append(allRec, d)
	}
	unrecovered := map[string]int{}
	for _, id := range rec.pending {
		unrecovered[rec.faults[id].Kind]++
	}
	fmt.Fprintf(&b, "faults: %d; recovery = from a fault's end to the first sampler round with every pod unchanged since before it in its policy state\n", len(rec.faults))
	for _, k := range sortedKeys(byKind) {
		var d []time.Duration
		errs := 0
		for _, f := range byKind[k] {
			d = append(d, f.End.Sub(f.Start))
			if f.Err != nil {
				errs++
			}
		}
		rd := recByKind[k]
		fmt.Fprintf(&b, "  %-20s %4d  (lasting p50 %v, max %v; %d failed to run; recovery p50 %v, p99 %v, max %v, %d never)\n", k, len(d),
			e2eenv.Percentile(d, .5).Round(time.Millisecond), e2eenv.Percentile(d, 1).Round(time.Millisecond), errs,
			e2eenv.Percentile(rd, .5).Round(time.Millisecond), e2eenv.Percentile(rd, .99).Round(time.Millisecond),
			e2eenv.Percentile(rd, 1).Round(time.Millisecond), unrecovered[k])
	}
	fmt.Fprintf(&b, "samples: %d in %d rounds; gap between two samples of one pod (outside its churn operations) p50 %v, p99 %v, max %v\n",
		r.rec.samples.Load(), len(rec.rounds), e2eenv.Percentile(rec.gaps, .5).Round(time.Millisecond),
		e2eenv.Percentile(rec.gaps, .99).Round(time.Millisecond), e2eenv.Percentile(rec.gaps, 1).Round(time.Millisecond))
	for _, k := range []struct{ kind, what string }{
		{kindBypass, "claimed enrolled, a direction direct"},
		{kindBlackHole, "a direction dead while a ztunnel served"},
	} {
		w := rec.windows[k.kind]
		fmt.Fprintf(&b, "%s windows (%s), within the bound or not: %d, p50 %v, p99 %v, max %v\n", k.kind, k.what, len(w),
			e2eenv.Percentile(w, .5).Round(time.Millisecond), e2eenv.Percentile(w, .99).Round(time.Millisecond), e2eenv.Percentile(w, 1).Round(time.Millisecond))
	}
	fmt.Fprintf(&b, "recovery per fault (its end → every pod unchanged since before it in its policy state; other faults may still be in flight): %d faults, p50 %v, p99 %v, max %v; %d not recovered when the run settled\n",
		len(allRec), e2eenv.Percentile(allRec, .5).Round(time.Millisecond), e2eenv.Percentile(allRec, .99).Round(time.Millisecond),
		e2eenv.Percentile(allRec, 1).Round(time.Millisecond), len(rec.pending))
	fmt.Fprintf(&b, "recovery per storm (end of a storm of faults → every pod in its policy state): %d storms, p50 %v, p99 %v, max %v\n",
		len(rec.recoveries), e2eenv.Percentile(rec.recoveries, .5).Round(time.Millisecond),
		e2eenv.Percentile(rec.recoveries, .99).Round(time.Millisecond), e2eenv.Percentile(rec.recoveries, 1).Round(time.Millisecond))
	b.WriteString("leaks at the end (every pod deleted):\n")
	for _, l := range r.leaks {
		mark := "ok  "
		if !l.ok {
			mark = "LEAK"
		}
		fmt.Fprintf(&b, "  %s %s: %s (want %s)\n", mark, l.name, l.got, l.want)
	}
	kinds := map[string]int{}
	for _, v := range r.violations {
		kinds[v.Kind]++
	}
	fmt.Fprintf(&b, "violations: %d", len(r.violations))
	for _, k := range sortedKeys(kinds) {
		fmt.Fprintf(&b, "; %s %d", k, kinds[k])
	}
	b.WriteString("\n")
	for i, v := range r.violations {
		if i == 20 {
			fmt.Fprintf(&b, "  ... and %d more\n", len(r.violations)-20)
			break
		}
		fmt.Fprintf(&b, "  [%s] at %.1fs pod %s: %s\n", v.Kind, v.At.Sub(rec.start).Seconds(), v.Pod, v.Detail)
		fmt.Fprintf(&b, "      faults in flight: %s; %s\n", orNone(v.InFlight), v.LastEnd)
		for _, l := range v.Log {
			fmt.Fprintf(&b, "      | %s\n", l)
		}
	}
	return b.String()
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

func sortedKeys[V any](m map[string]V) []string {
	var k []string
	for key := range m {
		k = append(k, key)
	}
	slices.Sort(k)
	return k
}
