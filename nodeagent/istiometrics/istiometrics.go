// Package istiometrics exports, beside ambientd's own metrics, the metrics
// Istio's istio-cni node agent exports, under Istio's names, types, labels
// and label values, counted from ambientd's equivalent events, so the
// alerts and dashboards a platform team wrote for istio-cni keep working
// when ambientd replaces it (docs/metrics.md, "Istio's names").
//
// The facts are read from Istio's source (master): the names and labels in
// cni/pkg/install/monitoring.go, cni/pkg/nodeagent/cni-watcher.go,
// cni/pkg/nodeagent/informers.go and cni/pkg/nodeagent/ztunnelserver.go;
// where they are counted in cni/pkg/install/install.go and the same
// nodeagent files. Istio exports through OpenTelemetry's Prometheus exporter
// without unit or counter suffixes and without scope labels
// (pkg/monitoring/monitoring.go, RegisterPrometheusExporter), so a scrape
// shows exactly these names, a Sum as a counter and a Gauge as a gauge.
//
// A nil *Metrics is valid and counts nothing: the names are off.
package istiometrics

import (
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// The exported names (Istio's).
const (
	PluginRequestsName   = "istio_cni_plugin_requests_total"
	ReconcileEventsName  = "nodeagent_reconcile_events_total"
	ZtunnelConnectedName = "ztunnel_connected"
	InstallsName         = "istio_cni_installs_total"
	InstallReadyName     = "istio_cni_install_ready"
)

// ResponseCodes are the values of istio_cni_plugin_requests_total's
// response_code label: the HTTP status Istio's agent answers its plugin
// with (200 handled, 400 a request it cannot read, 500 the pod could not
// be added).
var ResponseCodes = []int{http.StatusOK, http.StatusBadRequest, http.StatusInternalServerError}

// EventType is nodeagent_reconcile_events_total's type label: the informer
// event's kind, as Istio's controllers.EventType prints it.
type EventType string

const (
	EventAdd    EventType = "add"
	EventUpdate EventType = "update"
	EventDelete EventType = "delete"
)

// EventTypes are every value of the type label.
var EventTypes = []EventType{EventAdd, EventUpdate, EventDelete}

// InstallResult is istio_cni_installs_total's result label (Istio's
// values, upper case as Istio writes them).
type InstallResult string

const (
	// InstallSuccess: an install round ended with the plugin installed
	// and its config valid (the first, and each one after a change).
	InstallSuccess InstallResult = "SUCCESS"
	// InstallCopyBinariesFailure: the plugin binary could not be copied.
	InstallCopyBinariesFailure InstallResult = "COPY_BINARIES_FAILURE"
	// InstallCreateKubeconfigFailure: the plugin's kubeconfig could not be
	// written.
	InstallCreateKubeconfigFailure InstallResult = "CREATE_KUBECONFIG_FAILURE"
	// InstallCreateCNIConfigFailure: the CNI config could not be written.
	InstallCreateCNIConfigFailure InstallResult = "CREATE_CNI_CONFIG_FAILURE"
)

// InstallResults are every value of the result label.
var InstallResults = []InstallResult{InstallSuccess, InstallCopyBinariesFailure, InstallCreateKubeconfigFailure, InstallCreateCNIConfigFailure}

// Metrics are the counters of Istio's names. Every label value exists from
// the start (at 0), as ambientd's own do, so rate() and alerts see a
// series; Istio's exporter shows a series only once it has a value.
type Metrics struct {
	pluginRequests  *prometheus.CounterVec
	reconcileEvents *prometheus.CounterVec
	installs        *prometheus.CounterVec
}

// New returns the counters; Register exports them.
func New() *Metrics {
	m := &Metrics{
		pluginRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: PluginRequestsName,
			Help: "CNI plugin ADD requests of pods in the ambient mesh the node agent answered, by HTTP response code as Istio's agent answers (200, 400, 500).",
		}, []string{"response_code"}),
		reconcileEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: ReconcileEventsName,
			Help: "Pod (this node's) and namespace informer events the node agent handled, by type (add, update, delete).",
		}, []string{"type"}),
		installs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: InstallsName,
			Help: "CNI plugin install rounds, by result (SUCCESS or the step that failed).",
		}, []string{"result"}),
	}
	for _, c := range ResponseCodes {
		m.pluginRequests.WithLabelValues(strconv.Itoa(c))
	}
	for _, t := range EventTypes {
		m.reconcileEvents.WithLabelValues(string(t))
	}
	for _, r := range InstallResults {
		m.installs.WithLabelValues(string(r))
	}
	return m
}

// PluginRequest counts one plugin request answered with HTTP status code.
func (m *Metrics) PluginRequest(code int) {
	if m == nil {
		return
	}
	m.pluginRequests.WithLabelValues(strconv.Itoa(code)).Inc()
}

// ReconcileEvent counts one informer event of type t.
func (m *Metrics) ReconcileEvent(t EventType) {
	if m == nil {
		return
	}
	m.reconcileEvents.WithLabelValues(string(t)).Inc()
}

// Install counts one install round's result r.
func (m *Metrics) Install(r InstallResult) {
	if m == nil {
		return
	}
	m.installs.WithLabelValues(string(r)).Inc()
}

// Sources are what the gauges read at scrape time, and whether the
// installer runs (istio_cni_installs_total is exported only then: nothing
// else installs).
type Sources struct {
	// ZtunnelConnections is the number of live ztunnel connections (nil:
	// no ztunnel_connected).
	ZtunnelConnections func() int
	// PluginInstalled is readiness's plugin check (nil: no
	// istio_cni_install_ready).
	PluginInstalled func() error
	// Installer: the agent runs the CNI installer (--install-cni).
	Installer bool
}

// Register exports the metrics with reg: the counters, and the gauges
// reading src. A nil m registers nothing.
func (m *Metrics) Register(reg prometheus.Registerer, src Sources) error {
	if m == nil {
		return nil
	}
	cs := []prometheus.Collector{m.pluginRequests, m.reconcileEvents}
	if src.ZtunnelConnections != nil {
		cs = append(cs, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: ZtunnelConnectedName,
			Help: "Live ztunnel connections.",
		}, func() float64 { return float64(src.ZtunnelConnections()) }))
	}
	if check := src.PluginInstalled; check != nil {
		cs = append(cs, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: InstallReadyName,
			Help: "1 when the CNI plugin is installed in the node's CNI config, else 0.",
		}, func() float64 {
			if check() != nil {
				return 0
			}
			return 1
		}))
	}
	if src.Installer {
		cs = append(cs, m.installs)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
