package kube

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// RequestMetrics counts the agent's own requests to the API server, by verb,
// resource and answer, as its transport sees them (rest.Config.Wrap): what
// one node costs the control plane, seen from the node (docs/scale.md). It
// also keeps the last minute's count for `ambientd status`.
type RequestMetrics struct {
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	bytes    *prometheus.CounterVec

	mu      sync.Mutex
	seconds [60]second // a ring of the last minute, one slot per second
}

type second struct {
	unix  int64
	count int
}

// NewRequestMetrics returns the metrics, not registered yet.
func NewRequestMetrics() *RequestMetrics {
	return &RequestMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_kube_requests_total",
			Help: "Requests of the agent to the Kubernetes API server, by verb (get, list, watch, create, update, patch, delete), resource (pods, pods/status, nodes/status, events, …) and HTTP code (\"error\": no answer).",
		}, []string{"verb", "resource", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ambientd_kube_request_duration_seconds",
			Help:    "Time from sending a request to the API server to its answer's headers (a watch: until it is established), by verb and resource.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"verb", "resource"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_kube_response_bytes_total",
			Help: "Bytes of the API server's answers the agent read, by verb and resource (a list, or a watch's initial events and every event after them).",
		}, []string{"verb", "resource"}),
	}
}

// Register adds the metrics to reg.
func (m *RequestMetrics) Register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.requests, m.latency, m.bytes} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// Wrap is a rest.Config.Wrap: it counts every request rt sends.
func (m *RequestMetrics) Wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripper{m: m, next: rt}
}

type roundTripper struct {
	m    *RequestMetrics
	next http.RoundTripper
}

func (t roundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	start := time.Now()
	resp, err := t.next.RoundTrip(req)
	verb, resource := RequestKind(req.Method, req.URL.Path, req.URL.Query().Get("watch"))
	code := "error"
	if err == nil {
		code = strconv.Itoa(resp.StatusCode)
	}
	t.m.requests.WithLabelValues(verb, resource, code).Inc()
	t.m.latency.WithLabelValues(verb, resource).Observe(time.Since(start).Seconds())
	t.m.count(start)
	if err == nil && resp.Body != nil {
		resp.Body = countingBody{ReadCloser: resp.Body, read: t.m.bytes.WithLabelValues(verb, resource)}
	}
	return resp, err
}

// countingBody counts the bytes read from an answer as they are read (a
// watch's body is read for the watch's life).
type countingBody struct {
	io.ReadCloser
	read prometheus.Counter
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.read.Add(float64(n))
	return n, err
}

func (m *RequestMetrics) count(at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := &m.seconds[at.Unix()%int64(len(m.seconds))]
	if s.unix != at.Unix() {
		*s = second{unix: at.Unix()}
	}
	s.count++
}

// LastMinute returns how many requests were sent in the minute before now.
func (m *RequestMetrics) LastMinute(now time.Time) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, s := range m.seconds {
		if age := now.Unix() - s.unix; age >= 0 && age < int64(len(m.seconds)) {
			n += s.count
		}
	}
	return n
}

// RequestKind names a request to the API server as the API server's own
// metrics do: its verb (a GET is get, list or watch) and its resource
// with the subresource ("pods/status"); "" for a path outside the API
// (/healthz, /version).
func RequestKind(method, path, watch string) (verb, resource string) {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	switch {
	case len(parts) >= 2 && parts[0] == "api":
		parts = parts[2:] // /api/v1
	case len(parts) >= 3 && parts[0] == "apis":
		parts = parts[3:] // /apis/<group>/<version>
	default:
		return strings.ToLower(method), ""
	}
	if len(parts) >= 2 && parts[0] == "namespaces" && len(parts) != 2 {
		parts = parts[2:] // a namespaced resource, not the namespace itself
	}
	named := len(parts) >= 2
	if len(parts) >= 3 {
		resource = parts[0] + "/" + parts[2]
	} else if len(parts) >= 1 {
		resource = parts[0]
	}
	switch method {
	case http.MethodGet:
		switch {
		case watch == "true" || watch == "1":
			verb = "watch"
		case named:
			verb = "get"
		default:
			verb = "list"
		}
	case http.MethodPost:
		verb = "create"
	case http.MethodPut:
		verb = "update"
	case http.MethodPatch:
		verb = "patch"
	case http.MethodDelete:
		verb = "delete"
		if !named {
			verb = "deletecollection"
		}
	default:
		verb = strings.ToLower(method)
	}
	return verb, resource
}
