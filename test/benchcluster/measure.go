package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// series are samples of the apiserver's /metrics by their name and labels
// in a fixed text form (key): a counter's or gauge's value; a histogram's or
// summary's _sum and _count as two samples.
type series map[string]float64

// snapshot is what the benchmark reads from the control plane at one moment:
// the apiserver's metrics and the CPU time etcd and the apiserver used.
type snapshot struct {
	at      time.Time
	metrics series
	// CPU of each process so far, by pid (a restarted apiserver is a new
	// pid, whose CPU starts again from zero).
	apiserverPid, etcdPid int
	apiserverCPU, etcdCPU time.Duration
	apiserverRSS          int64 // bytes
}

// key renders a series' name and the labels the benchmark groups by.
func key(name string, labels map[string]string) string {
	names := make([]string, 0, len(labels))
	for k := range labels {
		names = append(names, k)
	}
	sort.Strings(names)
	var b strings.Builder
	b.WriteString(name)
	b.WriteByte('{')
	for i, k := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%q", k, labels[k])
	}
	b.WriteByte('}')
	return b.String()
}

// wanted are the metric families the benchmark keeps (the apiserver exposes
// thousands of series).
var wanted = []string{
	"apiserver_request_total",
	"apiserver_longrunning_requests",
	"apiserver_registered_watchers",
	"apiserver_watch_events_total",
	"apiserver_watch_events_sizes",
	"apiserver_response_sizes",
	"etcd_requests_total",
	"etcd_request_duration_seconds",
	// API Priority and Fairness, by priority level (the agents' own,
	// ambientd, when deploy/apf.yaml is applied).
	"apiserver_flowcontrol_dispatched_requests_total",
	"apiserver_flowcontrol_rejected_requests_total",
	"apiserver_flowcontrol_request_wait_duration_seconds",
	"apiserver_flowcontrol_nominal_limit_seats",
}

// parseMetrics reads the Prometheus text exposition and keeps the wanted
// families.
func parseMetrics(r io.Reader) (series, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("parse apiserver /metrics: %w", err)
	}
	out := series{}
	for name, f := range fams {
		if !slices.Contains(wanted, name) {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				out[key(name, labels)] += m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[key(name, labels)] += m.GetGauge().GetValue()
			case dto.MetricType_UNTYPED:
				out[key(name, labels)] += m.GetUntyped().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[key(name+"_sum", labels)] += m.GetHistogram().GetSampleSum()
				out[key(name+"_count", labels)] += float64(m.GetHistogram().GetSampleCount())
			case dto.MetricType_SUMMARY:
				out[key(name+"_sum", labels)] += m.GetSummary().GetSampleSum()
				out[key(name+"_count", labels)] += float64(m.GetSummary().GetSampleCount())
			}
		}
	}
	return out, nil
}

// scraper reads the apiserver's /metrics with the admin's credentials.
type scraper struct {
	cp   *e2eenv.ControlPlane
	http *http.Client
}

func newScraper(cp *e2eenv.ControlPlane) (*scraper, error) {
	hc, err := rest.HTTPClientFor(cp.AdminConfig)
	if err != nil {
		return nil, err
	}
	hc.Timeout = 30 * time.Second
	return &scraper{cp: cp, http: hc}, nil
}

func (s *scraper) snapshot(ctx context.Context) (snapshot, error) {
	snap := snapshot{at: time.Now()}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.cp.URL+"/metrics", nil)
	if err != nil {
		return snap, err
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return snap, fmt.Errorf("GET apiserver /metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return snap, fmt.Errorf("GET apiserver /metrics: status %d: %s", resp.StatusCode, b)
	}
	if snap.metrics, err = parseMetrics(resp.Body); err != nil {
		return snap, err
	}
	snap.apiserverPid, snap.etcdPid = s.cp.APIServer.Pid(), s.cp.Etcd.Pid()
	snap.apiserverCPU, _ = processCPU(snap.apiserverPid)
	snap.etcdCPU, _ = processCPU(snap.etcdPid)
	snap.apiserverRSS = processRSS(snap.apiserverPid)
	return snap, nil
}

// processCPU is the user + system CPU time pid used so far (/proc/pid/stat,
// in clock ticks of 1/100 s, the value on every Linux architecture Go runs
// the benchmark on).
func processCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces; the rest follows ")".
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: utime/stime: %v %v", pid, err1, err2)
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}

// processRSS is pid's resident memory (VmRSS) in bytes.
func processRSS(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb * 1024
			}
		}
	}
	return 0
}

// delta is what a counter grew by between two snapshots. A counter that
// went down was reset (the apiserver restarted): it grew by its new value,
// as Prometheus' increase() takes it.
func delta(before, after series, k string) float64 {
	a, b := after[k], before[k]
	if a < b {
		return a
	}
	return a - b
}

// match reports whether series key k is of metric name with every label in
// want (label=value).
func match(k, name string, want ...string) bool {
	if !strings.HasPrefix(k, name+"{") {
		return false
	}
	for _, w := range want {
		l, v, _ := strings.Cut(w, "=")
		if !strings.Contains(k, l+"="+strconv.Quote(v)) {
			return false
		}
	}
	return true
}

// label is the value of label l in series key k ("" when absent).
func label(k, l string) string {
	i := strings.Index(k, "{"+l+"=\"")
	if i < 0 {
		i = strings.Index(k, ","+l+"=\"")
	}
	if i < 0 {
		return ""
	}
	rest := k[i+len(l)+2:]
	v, err := strconv.QuotedPrefix(rest)
	if err != nil {
		return ""
	}
	u, _ := strconv.Unquote(v)
	return u
}

// sumDelta sums the deltas of every series of name with the labels in want.
func sumDelta(before, after series, name string, want ...string) float64 {
	var s float64
	for k := range after {
		if match(k, name, want...) {
			s += delta(before, after, k)
		}
	}
	return s
}

// sumGauge sums a gauge's series of name with the labels in want.
func sumGauge(s series, name string, want ...string) float64 {
	var v float64
	for k, x := range s {
		if match(k, name, want...) {
			v += x
		}
	}
	return v
}

// groupDelta sums the deltas of name by the values of the labels by
// ("verb resource"), leaving out zero groups.
func groupDelta(before, after series, name string, by []string, want ...string) map[string]float64 {
	out := map[string]float64{}
	for k := range after {
		if !match(k, name, want...) {
			continue
		}
		d := delta(before, after, k)
		if d == 0 {
			continue
		}
		var parts []string
		for _, l := range by {
			parts = append(parts, label(k, l))
		}
		out[strings.Join(parts, " ")] += d
	}
	return out
}

// etcdWrites is how many writes the apiserver sent to etcd: the storage
// layer's create, update (GuaranteedUpdate) and delete operations. Newer
// apiservers count them in etcd_requests_total, older ones only in the
// latency histogram's _count.
func etcdWrites(before, after series) float64 {
	name := "etcd_requests_total"
	if sumGauge(after, name) == 0 {
		name = "etcd_request_duration_seconds_count"
	}
	var n float64
	for _, op := range []string{"create", "update", "delete", "GuaranteedUpdate"} {
		n += sumDelta(before, after, name, "operation="+op)
	}
	return n
}
