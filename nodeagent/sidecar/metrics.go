package sidecar

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	adds     *prometheus.CounterVec
	addTime  prometheus.Histogram
	repairs  prometheus.Counter
	failures prometheus.Counter
}

// newMetrics registers sidecar mode's metrics with reg (nil: a private
// registry).
func newMetrics(reg prometheus.Registerer, pods func() int) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{
		adds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_sidecar_adds_total",
			Help: "CNI ADDs of sidecar pods (an injected istio-proxy), by result: captured, invalid_annotation, error.",
		}, []string{"result"}),
		addTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "ambientd_sidecar_add_seconds",
			Help:    "Time to read a sidecar pod and program its rules at CNI ADD.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		repairs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ambientd_sidecar_repairs_total",
			Help: "Sidecar pods whose rules were found drifted (drift pass or restart) and repaired.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ambientd_sidecar_verify_failures_total",
			Help: "Sidecar pods whose rules could not be verified or repaired by the drift pass or a restart.",
		}),
	}
	for _, r := range []string{"captured", "invalid_annotation", "error"} {
		m.adds.WithLabelValues(r)
	}
	for _, c := range []prometheus.Collector{m.adds, m.addTime, m.repairs, m.failures,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ambientd_sidecar_pods",
			Help: "Sidecar pods of this node whose rules the agent programmed and keeps.",
		}, func() float64 { return float64(pods()) }),
	} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
