package agent

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// metrics are the agent's own collectors, in a registry of their own (no
// global state; tests can run several agents). docs/metrics.md is the
// reference of every name, label and label value; the e2e suite scrapes a
// running agent against it.
type metrics struct {
	reg         *prometheus.Registry
	failures    *prometheus.CounterVec
	retries     *prometheus.CounterVec
	enrollments prometheus.Counter
	cniAdds     *prometheus.CounterVec
	cniAddTime  *prometheus.HistogramVec
	removals    *prometheus.CounterVec
	annotations *prometheus.CounterVec
	steps       *prometheus.HistogramVec
	// addSteps is each CNI ADD's breakdown (addtrace.go).
	addSteps *prometheus.HistogramVec
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
	// podMeshReady is, per pod, from its creation to its condition first
	// True/Enrolled.
	podMeshReady prometheus.Histogram
}

// meshReadyBuckets span 0.25 s .. 17 min: a new pod is enrolled within a
// second or two of its creation when its node is ready; a pod that waited
// for a ztunnel or a node still starting takes minutes.
var meshReadyBuckets = prometheus.ExponentialBuckets(0.25, 2, 13)

// repair kinds (label values of ambientd_repairs_total).
var repairKinds = []string{"pod_rules", "host_rules", "probe_set", "sandbox"}

// The fixed label values (docs/metrics.md lists them; a value outside these
// sets is a bug).
var (
	// failureReasons label ambientd_failures_total.
	failureReasons = []string{
		"pod_unknown", "bad_annotation", "netns", "netns_not_found", "rules",
		"no_ztunnel", "ztunnel_nack", "ztunnel", "probe_ips", "removal", "api", "deadline",
		"host_netns", "invalid_pod",
	}
	// retryReasons label ambientd_retries_total.
	retryReasons = []string{"pending", "api", "netns", "rules", "removal", "snapshot_ack", "other"}
	// removalReasons label ambientd_removals_total.
	removalReasons = []string{"left_mesh", "deleted", "sandbox_deleted", "fail_pending"}
	// steps label ambientd_enrollment_step_duration_seconds.
	steps = []string{"lookup", "netns", "rules", "ztunnel_ack", "probe_ips", "status_write"}
	// cniOutcomes label ambientd_cni_add_total and ambientd_cni_add_duration_seconds.
	cniOutcomes = []string{"enrolled", "pending", "not-in-mesh", "sidecar", "unknown", "error"}
	// phases label ambientd_pods (a pod the agent does not hold is absent
	// and not counted).
	phases = []registry.Phase{registry.Unverified, registry.Pending, registry.Enabled, registry.Releasing, registry.Uncaptured, registry.Unserved}
	// notReadyReasons label ambientd_pods_not_ready: the reasons of a False
	// pod condition a registered pod can show (status.go).
	notReadyReasons = []string{ReasonPending, ReasonZtunnelUnavailable, ReasonZtunnelNotResponding, ReasonZtunnelRejected, ReasonRulesFailed, ReasonSandboxChanged, ReasonNetnsNotFound}
)

// durationBuckets span 0.5 ms .. 12 s: a CNI step takes milliseconds, a
// pod lookup of a pod the API does not know yet takes up to its timeout.
var durationBuckets = prometheus.ExponentialBuckets(0.0005, 2.5, 12)

// addStepBuckets span 50 µs .. 13 s, finer than durationBuckets: an idle
// ADD's steps take tens of microseconds to a few milliseconds.
var addStepBuckets = prometheus.ExponentialBuckets(0.00005, 2, 19)

func newMetrics(reg *registry.Registry, queueDepth func() int) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.newCounters()
	m.newHistograms()
	m.presetLabels()
	m.reg.MustRegister(m.failures, m.retries, m.enrollments, m.cniAdds, m.cniAddTime, m.removals,
		m.annotations, m.steps, m.addSteps, m.ackToEnabled, m.repairs, m.ruleWrites, m.verifyPass, m.podMeshReady,
		&podsCollector{reg: reg,
			desc:     prometheus.NewDesc("ambientd_pods", "Registered pods by lifecycle phase.", []string{"phase"}, nil),
			notReady: prometheus.NewDesc("ambientd_pods_not_ready", "Registered pods whose pod condition is False, by its reason.", []string{"reason"}, nil)},
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ambientd_workqueue_depth",
			Help: "Pod syncs waiting in the agent's workqueue.",
		}, func() float64 { return float64(queueDepth()) }),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return m
}

// newCounters makes the agent's counters.
func (m *metrics) newCounters() {
	m.failures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_failures_total",
		Help: "Failures while enrolling or removing pods, by reason.",
	}, []string{"reason"})
	m.retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_retries_total",
		Help: "Pod syncs queued again, by reason.",
	}, []string{"reason"})
	m.enrollments = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ambientd_enrollments_total",
		Help: "Pods moved to enabled (ztunnel acked them and their probe IPs are in place).",
	})
	m.cniAdds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_cni_add_total",
		Help: "CNI ADD events handled, by outcome.",
	}, []string{"outcome"})
	m.removals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_removals_total",
		Help: "Pods taken out of the mesh, by reason.",
	}, []string{"reason"})
	m.annotations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_annotation_writes_total",
		Help: "Attempts to write the redirection annotation, by result (ok, retry, dropped).",
	}, []string{"result"})
	m.repairs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ambientd_repairs_total",
		Help: "Drift found and repaired (restart verification, the periodic drift pass, syncs), by what: pod_rules, host_rules, probe_set, sandbox (a pod found in another sandbox than the one it was enrolled in).",
	}, []string{"what"})
	m.ruleWrites = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ambientd_pod_rule_writes_total",
		Help: "Pod rule writes (enrollments and repairs); verifying intact rules writes nothing.",
	})
}

// newHistograms makes the agent's histograms.
func (m *metrics) newHistograms() {
	m.cniAddTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "ambientd_cni_add_duration_seconds",
		Help:    "Time the agent took to handle a CNI ADD, by outcome.",
		Buckets: durationBuckets,
	}, []string{"outcome"})
	m.steps = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "ambientd_enrollment_step_duration_seconds",
		Help:    "Duration of enrollment steps, by step.",
		Buckets: durationBuckets,
	}, []string{"step"})
	m.addSteps = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "ambientd_cni_add_step_duration_seconds",
		Help:    "Each CNI ADD's steps from the plugin's start to the agent's answer, by step (plugin_init, plugin_config as the plugin reports them; dial; the agent's check, netns, lookup, queue, rules, ztunnel_ack, probe_ips; agent = the agent's whole answer).",
		Buckets: addStepBuckets,
	}, []string{"step"})
	m.ackToEnabled = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ambientd_snapshot_ack_to_enabled_seconds",
		Help:    "From a ztunnel's snapshot ack to a pending pod being enabled.",
		Buckets: durationBuckets,
	})
	m.verifyPass = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ambientd_verify_pass_duration_seconds",
		Help:    "Duration of one drift-verification pass over the enrolled pods and the host rules.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 12),
	})
	m.podMeshReady = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ambientd_pod_mesh_ready_seconds",
		Help:    "From a pod's creation (metadata.creationTimestamp, the API server's clock, whole seconds) to its pod condition first written True/Enrolled.",
		Buckets: meshReadyBuckets,
	})
}

// presetLabels makes every fixed label value exist from the start, so a
// rate() or an alert sees 0, not an absent series.
func (m *metrics) presetLabels() {
	for _, r := range failureReasons {
		m.failures.WithLabelValues(r)
	}
	for _, r := range retryReasons {
		m.retries.WithLabelValues(r)
	}
	for _, r := range removalReasons {
		m.removals.WithLabelValues(r)
	}
	for _, o := range cniOutcomes {
		m.cniAdds.WithLabelValues(o)
		m.cniAddTime.WithLabelValues(o)
	}
	for _, s := range steps {
		m.steps.WithLabelValues(s)
	}
	for _, s := range addSteps {
		m.addSteps.WithLabelValues(s)
	}
	for _, r := range []string{"ok", "retry", "dropped"} {
		m.annotations.WithLabelValues(r)
	}
	for _, k := range repairKinds {
		m.repairs.WithLabelValues(k)
	}
}

// podsCollector counts registered pods per phase, and those whose condition
// is False per reason (derived as statusFor derives it), in one pass at
// scrape time.
type podsCollector struct {
	reg            *registry.Registry
	desc, notReady *prometheus.Desc
}

func (c *podsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc; ch <- c.notReady }

func (c *podsCollector) Collect(ch chan<- prometheus.Metric) {
	n := map[registry.Phase]int{}
	why := map[string]int{}
	for _, e := range c.reg.List() {
		n[e.Phase]++
		if st, ok := statusFor(e, true); ok && st.Condition.Status == corev1.ConditionFalse {
			why[st.Condition.Reason]++
		}
	}
	for _, p := range phases {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n[p]), p.String())
	}
	for _, r := range notReadyReasons {
		ch <- prometheus.MustNewConstMetric(c.notReady, prometheus.GaugeValue, float64(why[r]), r)
	}
}

func (m *metrics) failure(reason string) { m.failures.WithLabelValues(reason).Inc() }

// meshReady is the status writer's OnWritten: a write that turned a pod's
// condition True/Enrolled for the first time observes the pod's age then.
// A pod with no creation time (none the API gave) is not observed; a
// negative age (clocks apart) counts as 0.
func (m *metrics) meshReady(st podstatus.Status, pod *corev1.Pod) {
	if !st.FirstTrue || pod == nil || pod.CreationTimestamp.IsZero() {
		return
	}
	m.podMeshReady.Observe(max(time.Since(pod.CreationTimestamp.Time), 0).Seconds())
}

// step observes an enrollment step that began at start, and adds it to
// the CNI ADD's breakdown when ctx is an ADD's.
func (m *metrics) step(ctx context.Context, name string, start time.Time) {
	d := time.Since(start)
	m.steps.WithLabelValues(name).Observe(d.Seconds())
	traceOf(ctx).add(name, d)
}

// removal counts a pod leaving the mesh; a policy reason (the pod or its
// namespace no longer enrolled) is left_mesh.
func (m *metrics) removal(reason string) {
	switch reason {
	case "deleted", "sandbox_deleted", "fail_pending":
	default:
		reason = "left_mesh"
	}
	m.removals.WithLabelValues(reason).Inc()
}

// retry counts a sync queued again after err.
func (m *metrics) retry(err error) {
	reason := "other"
	switch {
	case errors.Is(err, ErrPending):
		reason = "pending"
	case errors.Is(err, ErrAPIUnavailable):
		reason = "api"
	case errors.Is(err, ErrNetnsUnusable):
		reason = "netns"
	case errors.Is(err, ErrNotCaptured):
		reason = "rules"
	}
	m.retries.WithLabelValues(reason).Inc()
}

func outcomeLabel(o Outcome, err error) string {
	switch {
	case err != nil:
		return "error"
	case o == Enrolled, o == Pending, o == NotInMesh, o == SidecarCaptured:
		return o.String()
	}
	return "unknown"
}
