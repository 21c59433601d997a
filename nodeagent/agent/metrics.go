package agent

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/ambientd/ambientd/nodeagent/registry"
)

// metrics are the agent's own collectors, in a registry of their own (no
// global state; tests can run several agents).
type metrics struct {
	reg         *prometheus.Registry
	failures    *prometheus.CounterVec
	cniAdds     *prometheus.CounterVec
	removals    *prometheus.CounterVec
	annotations *prometheus.CounterVec
	steps       *prometheus.HistogramVec
	// ackToEnabled is the agent's own measure of how fast a pending pod is
	// enabled once a ztunnel acked its snapshot.
	ackToEnabled prometheus.Histogram
	// repairs counts drift found and repaired, by what (pod_rules,
	// host_rules, probe_set); ruleWrites every pod rule write the agent
	// ran (an intact pod costs none: it is only read).
	repairs    *prometheus.CounterVec
	ruleWrites prometheus.Counter
	// verifyPass is the duration of one drift pass.
	verifyPass prometheus.Histogram
}

// repair kinds (label values of ambientd_repairs_total).
var repairKinds = []string{"pod_rules", "host_rules", "probe_set"}

// failure reasons (label values of ambientd_enrollment_failures_total).
var failureReasons = []string{
	"pod_unknown", "bad_annotation", "netns", "netns_not_found", "rules",
	"no_ztunnel", "ztunnel_nack", "ztunnel", "probe_ips", "removal", "api",
}

func newMetrics(reg *registry.Registry) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_enrollment_failures_total",
			Help: "Failures while enrolling or removing pods, by reason.",
		}, []string{"reason"}),
		cniAdds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_cni_add_total",
			Help: "CNI ADD events handled, by outcome (enrolled, pending, not-in-mesh, error).",
		}, []string{"outcome"}),
		removals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_pod_removals_total",
			Help: "Pods taken out of the mesh, by reason.",
		}, []string{"reason"}),
		annotations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_annotation_writes_total",
			Help: "Attempts to write the redirection annotation, by result (ok, retry, dropped).",
		}, []string{"result"}),
		steps: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ambientd_enrollment_step_duration_seconds",
			Help:    "Duration of enrollment steps (lookup, rules, ztunnel_add, probe).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 12),
		}, []string{"step"}),
	}
	m.ackToEnabled = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ambientd_snapshot_ack_to_enabled_seconds",
		Help:    "From a ztunnel's snapshot ack to a pending pod being enabled.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 12),
	})
	m.repairs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_repairs_total",
		Help: "Drift found and repaired (restart verification and the periodic drift pass), by what: pod_rules, host_rules, probe_set.",
	}, []string{"what"})
	for _, k := range repairKinds {
		m.repairs.WithLabelValues(k)
	}
	m.ruleWrites = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ambientd_pod_rule_writes_total",
		Help: "Pod rule writes (enrollments and repairs); verifying intact rules writes nothing.",
	})
	m.verifyPass = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ambientd_verify_pass_duration_seconds",
		Help:    "Duration of one drift-verification pass over the enrolled pods and the host rules.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 12),
	})
	for _, r := range failureReasons {
		m.failures.WithLabelValues(r)
	}
	count := func(phases ...registry.Phase) func() float64 {
		return func() float64 {
			n := 0
			for _, p := range phases {
				n += len(reg.UIDs(p))
			}
			return float64(n)
		}
	}
	m.reg.MustRegister(m.failures, m.cniAdds, m.removals, m.annotations, m.steps, m.ackToEnabled, m.repairs, m.ruleWrites, m.verifyPass,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ambientd_pods_pending", Help: "Registered pods ztunnel has not acked."}, count(registry.Pending, registry.Unverified)),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ambientd_pods_enabled", Help: "Registered pods ztunnel has acked."}, count(registry.Enabled)),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return m
}

func (m *metrics) failure(reason string) { m.failures.WithLabelValues(reason).Inc() }

func (m *metrics) step(name string, start time.Time) {
	m.steps.WithLabelValues(name).Observe(time.Since(start).Seconds())
}
