package main

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
)

// The cluster the extrapolation is for, and the kubelet's own periodic
// writes there (its defaults: node status reported every 5 minutes when
// unchanged, KEP-589; its Lease renewed every 10 s).
const (
	bigNodes          = 5000
	bigPodsPerNode    = 110
	kubeletStatusSecs = 300
	kubeletLeaseSecs  = 10
	// The agent's node condition heartbeat (--node-condition-heartbeat).
	agentHeartbeatSecs = 300
)

func itoa(n int) string { return strconv.Itoa(n) }

// num renders a count with thousands separators.
func num(f float64) string {
	neg := f < 0
	if neg {
		f = -f
	}
	s := strconv.FormatInt(int64(f+0.5), 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// rate renders a per-second figure with sensible precision.
func rate(f float64) string {
	switch {
	case f == 0:
		return "0"
	case f >= 100:
		return num(f)
	case f >= 1:
		return strconv.FormatFloat(f, 'f', 1, 64)
	default:
		return strconv.FormatFloat(f, 'g', 2, 64)
	}
}

// bytes renders a byte count in KiB/MiB.
func bytes(f float64) string {
	switch {
	case f >= 1<<20:
		return strconv.FormatFloat(f/(1<<20), 'f', 1, 64) + " MiB"
	case f >= 1<<10:
		return strconv.FormatFloat(f/(1<<10), 'f', 1, 64) + " KiB"
	default:
		return num(f) + " B"
	}
}

func secs(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + " s"
}

// watchersPerNode is the watches a node's agent holds: the apiserver's held
// watches at the steady state's end beyond those it held before any agent
// started, per agent.
func (r *result) watchersPerNode() float64 {
	p := r.phase("steady state")
	if p == nil || p.nodes == 0 {
		return 0
	}
	extra := sumGauge(p.after.metrics, "apiserver_longrunning_requests", "verb=WATCH") -
		sumGauge(r.baseline.metrics, "apiserver_longrunning_requests", "verb=WATCH")
	return extra / float64(p.nodes)
}

func (r *result) phase(name string) *phase {
	for _, p := range r.phases {
		if p.name == name {
			return p
		}
	}
	return nil
}

// perTouched divides n by the nodes a phase touched (0 when none).
func perTouched(p *phase, n float64) float64 {
	if p.touched == 0 {
		return 0
	}
	return n / float64(p.touched)
}

func (r *result) markdown() string {
	var b strings.Builder
	c := r.cfg
	fmt.Fprintf(&b, "\n## make bench-cluster: %d hollow nodes, %s\n\n", c.agents, r.date.Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(&b, "%s (at the start). One kube-apiserver + etcd (the e2e environment's), %d agents started, %d ready",
		r.machine, r.started, r.ready)
	if r.ready > 0 {
		fmt.Fprintf(&b, " (all ready %s after the first start, in batches of %d)", r.allReady.Round(time.Second), c.startBatch)
	}
	b.WriteString(". Each hollow node: a Node object, a network namespace with a veth to the apiserver, bin/ambientd (product defaults")
	if c.agentArgs != "" {
		fmt.Fprintf(&b, ", plus `%s`", c.agentArgs)
	}
	b.WriteString(") and a ztunnel emulator; no kubelet, no pod sandbox.")
	if r.agentRSS > 0 && r.ready > 0 {
		fmt.Fprintf(&b, " Agents' RSS after the steady state: %s in all, %s each.", bytes(float64(r.agentRSS)), bytes(float64(r.agentRSS)/float64(r.ready)))
	}
	b.WriteString("\n")
	for _, nr := range r.notReady {
		fmt.Fprintf(&b, "\n- not ready, left out: %s", firstLine(nr))
	}
	if len(r.notReady) > 0 {
		b.WriteString("\n")
	}

	b.WriteString("\n### What the agents asked (apiserver audit log: the agents' identity, user agent `ambientd/…`)\n\n")
	b.WriteString("| phase | what happened | window | nodes (touched) | requests: watches / other | busiest second (first to last) | other per node per s (all nodes) | other per touched node (most on one node) | writes | by verb and resource |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, p := range r.phases {
		a := p.agent
		perS := 0.0
		if p.nodes > 0 && p.window() > 0 {
			perS = float64(a.nonWatch) / float64(p.nodes) / p.window().Seconds()
		}
		kinds := strings.Join(a.kinds(), ", ")
		if kinds == "" {
			kinds = "none"
		}
		peak, span := a.busiest()
		fmt.Fprintf(&b, "| %s | %s | %s | %d (%d) | %s / %s | %s (%s) | %s | %s (%d) | %s | %s |\n",
			p.name, p.note, secs(p.window()), p.nodes, p.touched, num(float64(a.watches)), num(float64(a.nonWatch)), num(float64(peak)), secs(span),
			rate(perS), rate(perTouched(p, float64(a.nonWatch))), a.maxPerNode(), num(float64(a.writes)), kinds)
	}

	b.WriteString("\n`patch nodes/status` in a window where nothing changed on the node is the node condition's heartbeat (every 5 minutes per node, `--node-condition-heartbeat`).")
	if p := r.phase("apiserver restart"); p != nil {
		if n := p.failedBefore(p.readyAt); n > 0 {
			fmt.Fprintf(&b, " After the apiserver restart, %d of the agents' requests were answered with an error before the apiserver answered /readyz (it serves before it is ready; client-go retries).", n)
		}
	}
	b.WriteString("\n")

	b.WriteString("\n### What the apiserver served and stored (its `/metrics`: every client — the agents, the benchmark's own writes, the apiserver's loopback clients — and /proc)\n\n")
	b.WriteString("| phase | requests by verb (watches included) | watches held at the end | watch events sent (bytes) | LIST bytes | etcd writes | apiserver CPU | etcd CPU | apiserver RSS at the end |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	fmt.Fprintf(&b, "| before any agent | — | %s | — | — | — | — | — | %s |\n", num(sumGauge(r.baseline.metrics, "apiserver_longrunning_requests", "verb=WATCH")), bytes(float64(r.baseline.apiserverRSS)))
	for _, p := range r.phases {
		s := p.server()
		fmt.Fprintf(&b, "| %s | %s | %s | %s (%s) | %s | %s | %s | %s | %s |\n",
			p.name, byVerb(s.requests), num(s.watchersHeld), num(s.watchEvents), bytes(s.watchBytes), bytes(s.listBytes),
			num(s.etcdWrites), secs(s.apiserverCPU), secs(s.etcdCPU), bytes(float64(s.apiserverRSS)))
	}
	b.WriteString("\n`apiserver_request_total` counts a watch when it ends: the watches a window started and still holds are in the agents' table and the watches held, not here.")
	if p := r.phase("apiserver restart"); p != nil {
		b.WriteString(" The apiserver restart's counters are the new process's from its start (its own start-up requests included); requests sent while it was down are in neither the audit log nor the metrics.")
	}
	b.WriteString("\n")
	b.WriteString(r.apfTable())
	b.WriteString(r.extrapolation())
	return b.String()
}

// apfTable is what API Priority and Fairness did in each phase: the
// agents' own level (deploy/apf.yaml) against every other.
func (r *result) apfTable() string {
	var b strings.Builder
	b.WriteString("\n### API Priority and Fairness (the apiserver's `apiserver_flowcontrol_*`)\n\n")
	if len(r.apf) == 0 {
		b.WriteString("Not applied (`-apf=false`): the agents' requests took the apiserver's default flow schemas.\n")
		return b.String()
	}
	fmt.Fprintf(&b, "Applied before the agents started: %s (`deploy/apf.yaml`). Seats, requests and queue waits of the agents' level `%s`; refusals (429) at it and at every other level.\n\n", strings.Join(r.apf, ", "), apfLevel)
	b.WriteString("| phase | `ambientd` seats | dispatched at `ambientd` | mean queue wait | refused at `ambientd` | refused at every other level |\n|---|---|---|---|---|---|\n")
	for _, p := range r.phases {
		a := p.server().apf
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", p.name, num(a.seats), num(a.dispatched), a.meanWait().Round(time.Microsecond), num(a.rejected), num(a.rejectedOther))
	}
	b.WriteString("\nA watch counts as dispatched when it starts (its initial events hold a seat; the watch itself does not).\n")
	return b.String()
}

// byVerb sums "VERB resource" counts by verb ("GET 12, WATCH 300").
func byVerb(m map[string]float64) string {
	v := map[string]float64{}
	for k, n := range m {
		verb, _, _ := strings.Cut(k, " ")
		v[verb] += n
	}
	var keys []string
	for k := range v {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return v[keys[i]] > v[keys[j]] })
	var parts []string
	for _, k := range keys {
		parts = append(parts, k+" "+num(v[k]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// extrapolation scales the per-node figures to bigNodes × bigPodsPerNode
// beside the kubelet's own periodic writes there.
func (r *result) extrapolation() string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n### At %s nodes × %d pods\n\n", num(bigNodes), bigPodsPerNode)
	b.WriteString("Per node as measured above, times the node count. The kubelet's figures are its defaults, not measured here.\n\n")
	b.WriteString("| what | ambientd per node (measured) | ambientd, whole cluster | the kubelet, whole cluster |\n|---|---|---|---|\n")
	kubeletPeriodic := fmt.Sprintf("%s Lease writes/s (every %d s per node) + %s node status writes/s (every %d min when unchanged)",
		rate(bigNodes/float64(kubeletLeaseSecs)), kubeletLeaseSecs, rate(bigNodes/float64(kubeletStatusSecs)), kubeletStatusSecs/60)
	if p := r.phase("steady state"); p != nil && p.nodes > 0 {
		perS := float64(p.agent.nonWatch) / float64(p.nodes) / p.window().Seconds()
		heartbeat := fmt.Sprintf("the node condition's heartbeat (every %d min) falls in the window; at its period alone %s writes/s", agentHeartbeatSecs/60, rate(bigNodes/float64(agentHeartbeatSecs)))
		if p.window() < agentHeartbeatSecs*time.Second {
			heartbeat = fmt.Sprintf("plus the node condition's heartbeat (every %d min, longer than the window): %s writes/s", agentHeartbeatSecs/60, rate(bigNodes/float64(agentHeartbeatSecs)))
		}
		fmt.Fprintf(&b, "| steady state, requests but watches | %s/s (%d in %s on %d nodes: %s) | %s/s; %s | %s |\n",
			rate(perS), p.agent.nonWatch, secs(p.window()), p.nodes, orNone(p.agent.kinds()), rate(perS*bigNodes), heartbeat, kubeletPeriodic)
		w := r.watchersPerNode()
		fmt.Fprintf(&b, "| watches held | %.1f | %s (client-go renews each every 5–10 min: about %s watch requests/s) | its own (pods, its Node, the objects its pods use) |\n",
			w, num(w*bigNodes), rate(w*bigNodes/450))
	}
	if p := r.phase("rolling restart"); p != nil && p.touched > 0 {
		s := p.server()
		fmt.Fprintf(&b, "| a rolling restart (every agent once) | %s requests (%s watches), %s of watch events | %s requests, %s of watch events (+ one initial event per pod: %s pods) | — |\n",
			rate(perTouched(p, float64(p.agent.requests))), rate(perTouched(p, float64(p.agent.watches))), bytes(perTouched(p, s.watchBytes)),
			num(perTouched(p, float64(p.agent.requests))*bigNodes), bytes(perTouched(p, s.watchBytes)*bigNodes), num(bigNodes*bigPodsPerNode))
	}
	if p := r.phase("apiserver restart"); p != nil && p.touched > 0 {
		fmt.Fprintf(&b, "| an apiserver restart | %s requests (%s watches) | %s requests at once | its own watches, too |\n",
			rate(perTouched(p, float64(p.agent.requests))), rate(perTouched(p, float64(p.agent.watches))), num(perTouched(p, float64(p.agent.requests))*bigNodes))
	}
	if p := r.phase("pod churn (API-only pods)"); p != nil && p.pods > 0 {
		s := p.server()
		fmt.Fprintf(&b, "| a pod's life (API-only pods: create, delete) | %s agent requests on pods per pod; %s watch events on pods per pod (every client) | each pod's events go to its own node's agent only; a pod the agent enrolls costs one `patch pods/status` (`TestAPICostPerNode`): %s for every pod once | its pod status writes |\n",
			rate(float64(p.podRequests())/float64(p.pods)), rate(s.podWatchEvent/float64(p.pods)), num(bigNodes*bigPodsPerNode))
	}
	down, up := r.phase("ztunnel outage, every node"), r.phase("ztunnel back, every node")
	if down != nil && up != nil && down.touched > 0 {
		both := down.agent.plus(up.agent)
		w := float64(both.writes)
		fmt.Fprintf(&b, "| a ztunnel outage on every node and its end (no enrolled pods) | %s writes (%s, all nodes) | %s writes; with %d enrolled pods per node add one pod status write per pod each way: %s | — |\n",
			rate(w/float64(down.touched)), strings.Join(both.kinds(), ", "),
			num(w/float64(down.touched)*bigNodes), bigPodsPerNode, num(2*bigNodes*bigPodsPerNode))
	}
	return b.String()
}

// check holds the run to what cannot flake: every agent ready, every phase
// with numbers, and a steady state that cost nothing but watches.
func (r *result) check() error {
	var errs []error
	if r.ready != r.cfg.agents || len(r.notReady) > 0 {
		errs = append(errs, fmt.Errorf("%d of %d agents reached Ready: %s", r.ready, r.cfg.agents, strings.Join(r.notReady, "; ")))
	}
	want := []string{"first start", "steady state", "rolling restart", "apiserver restart", "pod churn (API-only pods)", "ztunnel outage, every node", "ztunnel back, every node"}
	for _, name := range want {
		p := r.phase(name)
		switch {
		case p == nil:
			errs = append(errs, fmt.Errorf("phase %q has no numbers", name))
		case len(p.before.metrics) == 0 || len(p.after.metrics) == 0 || len(p.server().requests) == 0:
			errs = append(errs, fmt.Errorf("phase %q: the apiserver's /metrics gave no request counts", name))
		case p.window() <= 0:
			errs = append(errs, fmt.Errorf("phase %q: empty window", name))
		}
	}
	// What each action must cost: a started agent lists its objects through
	// watches, and so does every agent whose apiserver came back.
	for _, name := range []string{"first start", "rolling restart", "apiserver restart"} {
		if p := r.phase(name); p != nil && p.agent.watches < p.touched {
			errs = append(errs, fmt.Errorf("phase %q: %d watches by the agents for %d nodes: the audit log's count is not working", name, p.agent.watches, p.touched))
		}
	}
	if p := r.phase("pod churn (API-only pods)"); p != nil && p.server().podWatchEvent == 0 {
		errs = append(errs, fmt.Errorf("pod churn: no watch event on pods for %d pods", p.pods))
	}
	// A ztunnel outage is one Event on the node each way (the agent's
	// ZtunnelUnavailable / ZtunnelAvailable), not one per component.
	for _, name := range []string{"ztunnel outage, every node", "ztunnel back, every node"} {
		p := r.phase(name)
		if p == nil || p.touched == 0 {
			continue
		}
		if ev := p.agent.byKind["create events"] + p.agent.byKind["patch events"]; ev > p.touched {
			errs = append(errs, fmt.Errorf("phase %q: %d Events written for %d nodes (budget: one per node)", name, ev, p.touched))
		}
	}
	if len(r.apf) > 0 {
		if p := r.phase("first start"); p != nil && p.server().apf.dispatched == 0 {
			errs = append(errs, fmt.Errorf("first start: no request dispatched at the %q priority level: the shipped FlowSchema does not match the agents", apfLevel))
		}
	}
	if p := r.phase("steady state"); p != nil && p.agent.nonWatch > 0 {
		errs = append(errs, fmt.Errorf("steady state: the agents made %d requests but watches in %s (budget: none): %s",
			p.agent.nonWatch, secs(p.window()), strings.Join(p.agent.kinds(), ", ")))
	}
	return errors.Join(errs...)
}

func orNone(l []string) string {
	if len(l) == 0 {
		return "none"
	}
	return strings.Join(l, ", ")
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}
