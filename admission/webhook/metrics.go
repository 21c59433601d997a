package webhook

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the webhook's collectors, in a registry of their own
// (docs/metrics.md lists them). A nil *Metrics records nothing.
type Metrics struct {
	Registry  *prometheus.Registry
	reviews   *prometheus.CounterVec
	rotations *prometheus.CounterVec
	expiry    *prometheus.GaugeVec
}

// outcomes label ambientd_webhook_reviews_total.
var outcomes = []string{"gated", "unchanged", "skipped", "undecided", "bad_request"}

// NewMetrics registers the webhook's collectors in a new registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		reviews: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_webhook_reviews_total",
			Help: "Admission reviews answered, by outcome: gated (the readiness gate added), unchanged (nothing to add), skipped (not a pod creation, or a namespace never mutated), undecided (settings or namespace unknown: not gated), bad_request (not an AdmissionReview).",
		}, []string{"outcome"}),
		rotations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_webhook_certificate_rotations_total",
			Help: "Certificates issued by this replica, by kind: leaf (its serving certificate) or ca (a new CA written to the Secret).",
		}, []string{"kind"}),
		expiry: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ambientd_webhook_certificate_expiry_timestamp_seconds",
			Help: "When the certificate in use expires (Unix time), by kind: leaf or ca.",
		}, []string{"kind"}),
	}
	for _, o := range outcomes {
		m.reviews.WithLabelValues(o)
	}
	for _, k := range []string{"leaf", "ca"} {
		m.rotations.WithLabelValues(k)
	}
	m.Registry.MustRegister(m.reviews, m.rotations, m.expiry)
	return m
}

func (m *Metrics) observe(outcome string) {
	if m != nil {
		m.reviews.WithLabelValues(outcome).Inc()
	}
}

func (m *Metrics) rotated(kind string, notAfter time.Time) {
	if m != nil {
		m.rotations.WithLabelValues(kind).Inc()
		m.expiry.WithLabelValues(kind).Set(float64(notAfter.Unix()))
	}
}

func (m *Metrics) inUse(kind string, notAfter time.Time) {
	if m != nil {
		m.expiry.WithLabelValues(kind).Set(float64(notAfter.Unix()))
	}
}
