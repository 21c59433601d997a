package ztunnel

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the server's Prometheus collectors. They are not registered
// anywhere; the agent registers them (Metrics implements prometheus.Collector).
type Metrics struct {
	connections prometheus.GaugeFunc
	accepted    prometheus.Counter
	retries     prometheus.Counter
	requests    *prometheus.CounterVec
	ackSeconds  *prometheus.HistogramVec
	handovers   *prometheus.CounterVec
	refused     prometheus.Counter
	hung        prometheus.Counter
}

// newMetrics returns the server's collectors; live counts the live
// connections when the gauge is scraped.
func newMetrics(live func() int) *Metrics {
	return &Metrics{
		connections: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ambientd_ztunnel_connections",
			Help: "Live ztunnel connections.",
		}, func() float64 { return float64(live()) }),
		accepted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ambientd_ztunnel_connections_accepted_total",
			Help: "ztunnel connections accepted.",
		}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ambientd_ztunnel_accept_retries_total",
			Help: "Temporary accept errors on the ztunnel socket (out of descriptors or memory), each retried after a backoff.",
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_ztunnel_requests_total",
			Help: "ZDS requests by operation and result (ok, nack, timeout, broken, no_ztunnel, canceled, netns_closed).",
		}, []string{"op", "result"}),
		ackSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ambientd_ztunnel_ack_duration_seconds",
			Help:    "Time from sending a ZDS request to its ack.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}, []string{"op"}),
		handovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_ztunnel_handovers_total",
			Help: "Pods of a closed ztunnel connection re-added to the newest remaining one, by result (ok, failed).",
		}, []string{"result"}),
		hung: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ambientd_ztunnel_unresponsive_total",
			Help: "ztunnel connections dropped because ztunnel did not answer a request (an Add, a Del or the idle probe) within the ack timeout: a hung ztunnel, whose pods are then not served.",
		}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ambientd_ztunnel_peers_refused_total",
			Help: "Connections to the ztunnel socket closed unserved because the peer's uid (SO_PEERCRED) is not an allowed ztunnel uid.",
		}),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.connections.Describe(ch)
	m.accepted.Describe(ch)
	m.retries.Describe(ch)
	m.requests.Describe(ch)
	m.ackSeconds.Describe(ch)
	m.handovers.Describe(ch)
	m.refused.Describe(ch)
	m.hung.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.connections.Collect(ch)
	m.accepted.Collect(ch)
	m.retries.Collect(ch)
	m.requests.Collect(ch)
	m.ackSeconds.Collect(ch)
	m.handovers.Collect(ch)
	m.refused.Collect(ch)
	m.hung.Collect(ch)
}
