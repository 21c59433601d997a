package main

import (
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

const exposition = `# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",resource="pods",verb="LIST"} 4
apiserver_request_total{code="200",component="apiserver",resource="nodes",verb="PATCH"} 7
apiserver_request_total{code="201",component="apiserver",resource="events",verb="POST"} 2
# HELP apiserver_longrunning_requests [STABLE] Gauge of long-running requests
# TYPE apiserver_longrunning_requests gauge
apiserver_longrunning_requests{component="apiserver",resource="pods",verb="WATCH"} 10
apiserver_longrunning_requests{component="apiserver",resource="nodes",verb="WATCH"} 5
apiserver_longrunning_requests{component="apiserver",resource="pods",verb="CONNECT"} 1
# HELP apiserver_response_sizes [STABLE] Response size distribution
# TYPE apiserver_response_sizes histogram
apiserver_response_sizes_bucket{resource="pods",verb="LIST",le="+Inf"} 4
apiserver_response_sizes_sum{resource="pods",verb="LIST"} 4096
apiserver_response_sizes_count{resource="pods",verb="LIST"} 4
# HELP etcd_requests_total Etcd request counts
# TYPE etcd_requests_total counter
etcd_requests_total{operation="create",type="events"} 2
etcd_requests_total{operation="update",type="nodes"} 7
etcd_requests_total{operation="get",type="nodes"} 30
# HELP process_cpu_seconds_total Total user and system CPU time
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12
`

func TestParseMetricsKeepsWantedFamilies(t *testing.T) {
	s, err := parseMetrics(strings.NewReader(exposition))
	if err != nil {
		t.Fatal(err)
	}
	if got := sumGauge(s, "apiserver_longrunning_requests", "verb=WATCH"); got != 15 {
		t.Errorf("watches held = %v, want 15 (CONNECT left out)", got)
	}
	if got := sumGauge(s, "apiserver_response_sizes_sum", "verb=LIST"); got != 4096 {
		t.Errorf("LIST bytes = %v, want 4096", got)
	}
	for k := range s {
		if strings.HasPrefix(k, "process_") {
			t.Errorf("kept %s, a family the benchmark does not read", k)
		}
	}
	if _, err := parseMetrics(strings.NewReader("not a metric line {")); err == nil {
		t.Error("garbage parsed without error")
	}
}

func TestDeltas(t *testing.T) {
	before, err := parseMetrics(strings.NewReader(exposition))
	if err != nil {
		t.Fatal(err)
	}
	grown := strings.NewReplacer(
		`verb="PATCH"} 7`, `verb="PATCH"} 17`,
		`operation="update",type="nodes"} 7`, `operation="update",type="nodes"} 17`,
		`operation="get",type="nodes"} 30`, `operation="get",type="nodes"} 90`,
	).Replace(exposition)
	after, err := parseMetrics(strings.NewReader(grown))
	if err != nil {
		t.Fatal(err)
	}
	if got := groupDelta(before, after, "apiserver_request_total", []string{"verb", "resource"}); len(got) != 1 || got["PATCH nodes"] != 10 {
		t.Errorf("requests grown = %v, want only PATCH nodes 10", got)
	}
	if got := etcdWrites(before, after); got != 10 {
		t.Errorf("etcd writes = %v, want 10 (reads left out)", got)
	}
	// A restarted apiserver starts its counters again: what it counted
	// since is the increase.
	restarted := strings.NewReplacer(`verb="PATCH"} 7`, `verb="PATCH"} 3`).Replace(exposition)
	reset, err := parseMetrics(strings.NewReader(restarted))
	if err != nil {
		t.Fatal(err)
	}
	if got := sumDelta(before, reset, "apiserver_request_total", "verb=PATCH"); got != 3 {
		t.Errorf("after a reset: PATCH grew by %v, want 3", got)
	}
	if got := cpuDelta(1, 2, 10*time.Second, 3*time.Second); got != 3*time.Second {
		t.Errorf("CPU of a restarted process = %v, want its own 3s", got)
	}
}

func TestLabel(t *testing.T) {
	k := key("m", map[string]string{"verb": "LIST", "resource": "pods", "x": `a"b`})
	for l, want := range map[string]string{"verb": "LIST", "resource": "pods", "x": `a"b`, "code": ""} {
		if got := label(k, l); got != want {
			t.Errorf("label(%s, %s) = %q, want %q", k, l, got, want)
		}
	}
	if match(k, "m", "verb=WATCH") || !match(k, "m", "verb=LIST", "resource=pods") || match(k, "mm") {
		t.Errorf("match(%s) wrong", k)
	}
}

func TestCountAgentByNode(t *testing.T) {
	at := time.Now()
	reqs := []e2eenv.AuditRequest{
		{Received: at, UserAgent: "ambientd/dev", Verb: "watch", Resource: "pods", SourceIP: "10.251.0.2", Code: 200},
		{Received: at, UserAgent: "ambientd/dev", Verb: "patch", Resource: "nodes", Subresource: "status", SourceIP: "10.251.0.2", Code: 200},
		{Received: at, UserAgent: "ambientd/dev", Verb: "patch", Resource: "nodes", Subresource: "status", SourceIP: "10.251.0.2", Code: 200},
		{Received: at, UserAgent: "ambientd/dev", Verb: "get", Resource: "nodes", SourceIP: "10.251.0.3", Code: 404},
		// The same identity through another program: not the agent's.
		{Received: at, UserAgent: "kubectl/v1.37", Verb: "get", Resource: "pods", SourceIP: "127.0.0.1", Code: 200},
	}
	c := countAgent(reqs)
	if c.requests != 4 || c.watches != 1 || c.nonWatch != 3 || c.writes != 2 || c.otherAgents != 1 {
		t.Errorf("counts %+v", c)
	}
	if c.maxPerNode() != 2 || c.perNode["10.251.0.3"] != 1 {
		t.Errorf("per node %v", c.perNode)
	}
	got := strings.Join(c.kinds(), ", ")
	if got != "patch nodes/status 2, answered 404 1, get nodes 1, watch pods 1" {
		t.Errorf("kinds = %q", got)
	}
	if both := c.plus(c); both.byKind["patch nodes/status"] != 4 || both.writes != 4 || both.failed[404] != 2 {
		t.Errorf("plus: %+v", both)
	}
}

// TestCheck: the short run's verdict fails on a steady state that made a
// request, on an agent that never got ready, and on a missing phase.
func TestCheck(t *testing.T) {
	snap := snapshot{metrics: series{key("apiserver_request_total", map[string]string{"verb": "GET", "resource": "nodes"}): 1}}
	later := snapshot{metrics: series{key("apiserver_request_total", map[string]string{"verb": "GET", "resource": "nodes"}): 2, key("apiserver_watch_events_total", map[string]string{"resource": "pods"}): 5}}
	good := func() *result {
		r := &result{cfg: config{agents: 2}, ready: 2}
		for _, name := range []string{"first start", "steady state", "rolling restart", "apiserver restart", "pod churn (API-only pods)", "ztunnel outage, every node", "ztunnel back, every node"} {
			p := &phase{name: name, nodes: 2, touched: 2, from: time.Unix(0, 0), to: time.Unix(10, 0), before: snap, after: later}
			p.agent = countAgent([]e2eenv.AuditRequest{
				{UserAgent: "ambientd/x", Verb: "watch", SourceIP: "a"}, {UserAgent: "ambientd/x", Verb: "watch", SourceIP: "b"},
			})
			r.phases = append(r.phases, p)
		}
		return r
	}
	if err := good().check(); err != nil {
		t.Fatalf("a good run fails: %v", err)
	}
	for name, spoil := range map[string]func(*result){
		"steady request": func(r *result) {
			r.phase("steady state").agent = countAgent([]e2eenv.AuditRequest{{UserAgent: "ambientd/x", Verb: "get", Resource: "nodes"}})
		},
		"agent not ready": func(r *result) { r.ready, r.notReady = 1, []string{"hollow-001: timeout"} },
		"phase missing":   func(r *result) { r.phases = r.phases[:3] },
		"no watches":      func(r *result) { r.phase("rolling restart").agent = agentCost{} },
		"no metrics":      func(r *result) { r.phase("pod churn (API-only pods)").after = snapshot{} },
		"two Events per node in an outage": func(r *result) {
			var reqs []e2eenv.AuditRequest
			for _, node := range []string{"a", "b"} {
				for range 2 {
					reqs = append(reqs, e2eenv.AuditRequest{UserAgent: "ambientd/x", Verb: "create", Resource: "events", SourceIP: node})
				}
			}
			r.phase("ztunnel outage, every node").agent = countAgent(reqs)
		},
		"APF applied, nothing at its level": func(r *result) { r.apf = []string{"FlowSchema/ambientd", "PriorityLevelConfiguration/ambientd"} },
	} {
		r := good()
		spoil(r)
		if err := r.check(); err == nil {
			t.Errorf("%s: check passed", name)
		}
	}
}

func TestNum(t *testing.T) {
	for in, want := range map[float64]string{0: "0", 999: "999", 1000: "1,000", 1234567: "1,234,567", -5000: "-5,000"} {
		if got := num(in); got != want {
			t.Errorf("num(%v) = %q, want %q", in, got, want)
		}
	}
}

func TestBusiest(t *testing.T) {
	at := func(s float64) e2eenv.AuditRequest {
		return e2eenv.AuditRequest{UserAgent: "ambientd/x", Verb: "watch", Received: time.Unix(100, 0).Add(time.Duration(s * float64(time.Second)))}
	}
	c := countAgent([]e2eenv.AuditRequest{at(0), at(0.5), at(0.9), at(1.2), at(4.1)})
	if peak, span := c.busiest(); peak != 3 || span != 5*time.Second {
		t.Errorf("busiest = %d in %s, want 3 in 5s", peak, span)
	}
	if peak, span := (agentCost{}).busiest(); peak != 0 || span != 0 {
		t.Errorf("no requests: busiest = %d in %s", peak, span)
	}
}
