package main

import (
	"sort"
	"strings"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// phase is one measured window and everything counted in it.
type phase struct {
	name  string // "steady state", …
	note  string // what happened, how many nodes took part
	nodes int    // agents running in the window
	// touched is how many nodes the phase's action hit (restarted agents,
	// nodes with churned pods): the per-node figures of a phase that hit
	// a few nodes are per touched node.
	touched  int
	pods     int // pods created and deleted (churn)
	from, to time.Time

	before, after snapshot
	reqs          []e2eenv.AuditRequest // the agents' identity's, from the audit log
	agent         agentCost
	// readyAt is when a restarted apiserver answered /readyz.
	readyAt time.Time
}

// failedBefore counts the agents' requests answered with an error that the
// apiserver received before t.
func (p *phase) failedBefore(t time.Time) int {
	n := 0
	for _, r := range p.reqs {
		if r.Code >= 400 && r.Received.Before(t) && strings.HasPrefix(r.UserAgent, "ambientd/") {
			n++
		}
	}
	return n
}

// podRequests counts the agents' requests about pods (not watches): what
// a pod's life costs, apart from what the node does meanwhile (the node
// condition's heartbeat).
func (p *phase) podRequests() int {
	n := 0
	for _, r := range p.reqs {
		if r.Resource == "pods" && r.Verb != "watch" && strings.HasPrefix(r.UserAgent, "ambientd/") {
			n++
		}
	}
	return n
}

func (p *phase) window() time.Duration { return p.to.Sub(p.from) }

// agentCost is what the agents asked of the apiserver in one window,
// counted from its audit log (the agents' identity, user agent ambientd/…),
// told apart by node by the address they came from.
type agentCost struct {
	requests    int            // every request, watches included
	watches     int            // watches started
	nonWatch    int            // every other request
	writes      int            // create/update/patch/delete
	byKind      map[string]int // "patch nodes/status" → count
	perNode     map[string]int // node address → non-watch requests
	otherAgents int            // requests of the identity with another user agent
	failed      map[int]int    // answers ≥ 400 by code
	// perSecond counts the requests by the second they were received
	// (Unix seconds): how a wave of them is spread over time.
	perSecond map[int64]int
}

// busiest is the most requests received within one second, and the span
// from the first request to the last.
func (c agentCost) busiest() (peak int, span time.Duration) {
	var first, last int64
	for sec, n := range c.perSecond {
		peak = max(peak, n)
		if first == 0 || sec < first {
			first = sec
		}
		last = max(last, sec)
	}
	if len(c.perSecond) > 0 {
		span = time.Duration(last-first+1) * time.Second
	}
	return peak, span
}

// countAgent sums the audit log's requests of the agents' identity.
func countAgent(reqs []e2eenv.AuditRequest) agentCost {
	c := agentCost{byKind: map[string]int{}, perNode: map[string]int{}, failed: map[int]int{}, perSecond: map[int64]int{}}
	for _, r := range reqs {
		if !strings.HasPrefix(r.UserAgent, "ambientd/") {
			c.otherAgents++
			continue
		}
		c.requests++
		if !r.Received.IsZero() {
			c.perSecond[r.Received.Unix()]++
		}
		kind := r.Verb + " " + r.Resource
		if r.Subresource != "" {
			kind += "/" + r.Subresource
		}
		c.byKind[kind]++
		if r.Code >= 400 {
			c.failed[r.Code]++
		}
		if r.Verb == "watch" {
			c.watches++
			continue
		}
		c.nonWatch++
		c.perNode[r.SourceIP]++
		if r.Write() {
			c.writes++
		}
	}
	return c
}

// maxPerNode is the most non-watch requests one node made.
func (c agentCost) maxPerNode() int {
	m := 0
	for _, n := range c.perNode {
		m = max(m, n)
	}
	return m
}

// plus is both windows' requests together.
func (c agentCost) plus(o agentCost) agentCost {
	sum := agentCost{
		requests: c.requests + o.requests, watches: c.watches + o.watches, nonWatch: c.nonWatch + o.nonWatch,
		writes: c.writes + o.writes, otherAgents: c.otherAgents + o.otherAgents,
		byKind: map[string]int{}, perNode: map[string]int{}, failed: map[int]int{}, perSecond: map[int64]int{},
	}
	for _, x := range []agentCost{c, o} {
		for k, n := range x.perSecond {
			sum.perSecond[k] += n
		}
		for k, n := range x.byKind {
			sum.byKind[k] += n
		}
		for k, n := range x.perNode {
			sum.perNode[k] += n
		}
		for k, n := range x.failed {
			sum.failed[k] += n
		}
	}
	return sum
}

// kinds lists byKind, most frequent first ("patch nodes/status 100"), and
// the answers that were errors ("answered 410: 3").
func (c agentCost) kinds() []string {
	type kv struct {
		k string
		n int
	}
	var l []kv
	for k, n := range c.byKind {
		l = append(l, kv{k, n})
	}
	for code, n := range c.failed {
		l = append(l, kv{"answered " + itoa(code), n})
	}
	sort.Slice(l, func(i, j int) bool {
		if l[i].n != l[j].n {
			return l[i].n > l[j].n
		}
		return l[i].k < l[j].k
	})
	out := make([]string, len(l))
	for i, x := range l {
		out[i] = x.k + " " + itoa(x.n)
	}
	return out
}

// serverCost is what the apiserver's own metrics say about a window: every
// client's requests (the agents', the benchmark's own pod and node writes,
// the apiserver's loopback clients), so read beside agentCost.
type serverCost struct {
	requests      map[string]float64 // "VERB resource" → count, watches included
	watchersHeld  float64            // WATCH long-running requests at the window's end
	watchEvents   float64            // events sent to watchers
	watchBytes    float64            // their bytes
	listBytes     float64            // bytes of LIST responses
	etcdWrites    float64
	apiserverCPU  time.Duration
	etcdCPU       time.Duration
	apiserverRSS  int64
	podWatchEvent float64 // events on pods sent to watchers
	apf           apfCost
}

// apfCost is what API Priority and Fairness did in a window: at the
// agents' priority level (apfLevel) and at every other.
type apfCost struct {
	seats         float64 // the agents' level's nominal seats at the window's end
	dispatched    float64 // requests the agents' level let through
	waitSum       float64 // their time in its queues, seconds
	rejected      float64 // requests the agents' level refused (429)
	rejectedOther float64 // requests every other level refused
}

// meanWait is the mean time a request of the agents' level waited.
func (c apfCost) meanWait() time.Duration {
	if c.dispatched == 0 {
		return 0
	}
	return time.Duration(c.waitSum / c.dispatched * float64(time.Second))
}

func (p *phase) server() serverCost {
	b, a := p.before.metrics, p.after.metrics
	s := serverCost{
		requests:      groupDelta(b, a, "apiserver_request_total", []string{"verb", "resource"}),
		watchersHeld:  sumGauge(a, "apiserver_longrunning_requests", "verb=WATCH"),
		watchEvents:   sumDelta(b, a, "apiserver_watch_events_total"),
		watchBytes:    sumDelta(b, a, "apiserver_watch_events_sizes_sum"),
		listBytes:     sumDelta(b, a, "apiserver_response_sizes_sum", "verb=LIST"),
		etcdWrites:    etcdWrites(b, a),
		podWatchEvent: sumDelta(b, a, "apiserver_watch_events_total", "resource=pods"),
		apiserverRSS:  p.after.apiserverRSS,
		apf: apfCost{
			seats:         sumGauge(a, "apiserver_flowcontrol_nominal_limit_seats", "priority_level="+apfLevel),
			dispatched:    sumDelta(b, a, "apiserver_flowcontrol_dispatched_requests_total", "priority_level="+apfLevel),
			waitSum:       sumDelta(b, a, "apiserver_flowcontrol_request_wait_duration_seconds_sum", "priority_level="+apfLevel, "execute=true"),
			rejected:      sumDelta(b, a, "apiserver_flowcontrol_rejected_requests_total", "priority_level="+apfLevel),
			rejectedOther: sumDelta(b, a, "apiserver_flowcontrol_rejected_requests_total") - sumDelta(b, a, "apiserver_flowcontrol_rejected_requests_total", "priority_level="+apfLevel),
		},
	}
	s.apiserverCPU = cpuDelta(p.before.apiserverPid, p.after.apiserverPid, p.before.apiserverCPU, p.after.apiserverCPU)
	s.etcdCPU = cpuDelta(p.before.etcdPid, p.after.etcdPid, p.before.etcdCPU, p.after.etcdCPU)
	return s
}

// cpuDelta is the CPU a process used in a window; a process restarted in it
// (a new pid) counts from its start (the old one's last moments are lost).
func cpuDelta(pidBefore, pidAfter int, before, after time.Duration) time.Duration {
	if pidBefore != pidAfter {
		return after
	}
	return after - before
}
