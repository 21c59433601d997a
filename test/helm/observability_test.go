package helm

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/ambientd/ambientd/test/helm/chartrender"
	"github.com/ambientd/ambientd/test/helm/dashboard"
)

// daemonSet is the chart's DaemonSet rendered with set.
func daemonSet(t *testing.T, set ...string) *appsv1.DaemonSet {
	t.Helper()
	var ds appsv1.DaemonSet
	if !objectsOf(t, chartDir, chartrender.Options{Set: set}).get(t, "DaemonSet", "ambientd", &ds) {
		t.Fatal("no DaemonSet ambientd")
	}
	return &ds
}

// metricsPort is the agent container's port named metrics.
func metricsPort(t *testing.T, ds *appsv1.DaemonSet) string {
	t.Helper()
	for _, p := range ds.Spec.Template.Spec.Containers[0].Ports {
		if p.Name == "metrics" {
			return strconv.Itoa(int(p.ContainerPort))
		}
	}
	t.Fatal("the agent's container has no port named metrics")
	return ""
}

// With the defaults, the agent's pods carry what Istio's chart puts on its
// agent's: the Prometheus scrape annotations pointing at the port the agent
// serves /metrics on, and k8s-app: istio-cni-node beside app: ambientd —
// while the DaemonSet's selector stays app: ambientd alone, as every
// release before had it (a selector is immutable: another one would make
// `helm upgrade` fail). The values turn each off; the port follows the
// agent's metrics address; podLabels and podAnnotations win over them.
func TestAgentPodsCarryIstiosScrapeAnnotationsAndLabel(t *testing.T) {
	scrape := map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": "15014", "prometheus.io/path": "/metrics"}
	for _, tt := range []struct {
		name       string
		set        []string
		annots     map[string]string // want these; "" = absent
		k8sApp     string            // "" = absent
		metricPort string
	}{
		{"defaults", nil, scrape, "istio-cni-node", "15014"},
		{"scrape annotations off", []string{"ambientd.metrics.scrapeAnnotations=false"},
			map[string]string{"prometheus.io/scrape": "", "prometheus.io/port": "", "prometheus.io/path": ""}, "istio-cni-node", "15014"},
		{"label off", []string{"ambientd.istioCniNodeLabel=false"}, scrape, "", "15014"},
		{"another metrics port", []string{"env.AMBIENTD_METRICS_ADDR=:9464"},
			map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": "9464", "prometheus.io/path": "/metrics"}, "istio-cni-node", "9464"},
		{"another metrics port in the ConfigMap", []string{"ambientd.config.AMBIENTD_METRICS_ADDR=0.0.0.0:9465"},
			map[string]string{"prometheus.io/port": "9465"}, "istio-cni-node", "9465"},
		{"the container's env wins over the ConfigMap", []string{"ambientd.config.AMBIENTD_METRICS_ADDR=:9465", "env.AMBIENTD_METRICS_ADDR=[::]:9466"},
			map[string]string{"prometheus.io/port": "9466"}, "istio-cni-node", "9466"},
		{"the user's annotation and label win", []string{"podAnnotations.prometheus\\.io/scrape=false", "podLabels.k8s-app=mine"},
			map[string]string{"prometheus.io/scrape": "false", "prometheus.io/port": "15014"}, "mine", "15014"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ds := daemonSet(t, tt.set...)
			tpl := ds.Spec.Template
			for k, want := range tt.annots {
				if got, ok := tpl.Annotations[k]; want == "" && ok || want != "" && got != want {
					t.Errorf("pod annotation %s = %q (set: %v), want %q", k, got, ok, want)
				}
			}
			if got := tpl.Labels["k8s-app"]; got != tt.k8sApp {
				t.Errorf("pod label k8s-app = %q, want %q", got, tt.k8sApp)
			}
			if tpl.Labels["app"] != "ambientd" || tpl.Labels["istio.io/dataplane-mode"] != "none" {
				t.Errorf("pod labels %v lost app=ambientd or istio.io/dataplane-mode=none", tpl.Labels)
			}
			if want := map[string]string{"app": "ambientd"}; !reflect.DeepEqual(ds.Spec.Selector.MatchLabels, want) || len(ds.Spec.Selector.MatchExpressions) > 0 {
				t.Errorf("DaemonSet selector %v, want exactly %v (immutable: a change breaks helm upgrade)", ds.Spec.Selector, want)
			}
			if got := metricsPort(t, ds); got != tt.metricPort {
				t.Errorf("container port metrics = %s, want %s", got, tt.metricPort)
			}
		})
	}
	if _, err := chartrender.Render(chartDir, chartrender.Options{Set: []string{"env.AMBIENTD_METRICS_ADDR=metrics"}}); err == nil || !strings.Contains(err.Error(), "AMBIENTD_METRICS_ADDR") {
		t.Errorf("a metrics address without a port: %v, want an error naming AMBIENTD_METRICS_ADDR", err)
	}
}

// optional returns the object kind/name of the chart rendered with set, nil
// if there is none.
func optional(t *testing.T, kind, name, namespace string, set ...string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range render(t, chartrender.Options{Namespace: namespace, Set: set}) {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

// The PodMonitor is an option (the Prometheus Operator's CRD may be
// missing): absent by default, and when enabled it scrapes the agent's pods
// in the release's namespace on their metrics port at /metrics, carrying
// the labels the user's Prometheus selects PodMonitors by.
func TestPodMonitorOptional(t *testing.T) {
	if o := optional(t, "PodMonitor", "ambientd", "istio-system"); o != nil {
		t.Fatal("PodMonitor rendered by default")
	}
	pm := optional(t, "PodMonitor", "ambientd", "mesh-agents", "ambientd.metrics.podMonitor.enabled=true",
		"ambientd.metrics.podMonitor.labels.release=kube-prometheus-stack", "ambientd.metrics.podMonitor.interval=15s")
	if pm == nil {
		t.Fatal("podMonitor.enabled: no PodMonitor ambientd")
	}
	if pm.GetAPIVersion() != "monitoring.coreos.com/v1" || pm.GetNamespace() != "mesh-agents" || pm.GetLabels()["release"] != "kube-prometheus-stack" {
		t.Errorf("PodMonitor %s in %q labels %v, want monitoring.coreos.com/v1 in mesh-agents with release=kube-prometheus-stack", pm.GetAPIVersion(), pm.GetNamespace(), pm.GetLabels())
	}
	sel, _, _ := unstructured.NestedStringMap(pm.Object, "spec", "selector", "matchLabels")
	ds := daemonSet(t)
	for k, v := range sel {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("PodMonitor selects %s=%s, which the agent's pods do not carry (%v)", k, v, ds.Spec.Template.Labels)
		}
	}
	if len(sel) == 0 {
		t.Error("PodMonitor selects every pod")
	}
	ns, _, _ := unstructured.NestedStringSlice(pm.Object, "spec", "namespaceSelector", "matchNames")
	if !reflect.DeepEqual(ns, []string{"mesh-agents"}) {
		t.Errorf("PodMonitor namespaces %v, want [mesh-agents]", ns)
	}
	eps, _, _ := unstructured.NestedSlice(pm.Object, "spec", "podMetricsEndpoints")
	want := []any{map[string]any{"port": "metrics", "path": "/metrics", "interval": "15s"}}
	if !reflect.DeepEqual(eps, want) {
		t.Errorf("PodMetricsEndpoints %v, want %v", eps, want)
	}
}

const dashboardFile = chartDir + "/files/ambientd-dashboard.json"

// The dashboard is an option: absent by default; enabled, a ConfigMap in
// the release's namespace labelled grafana_dashboard: "1" (the label
// Grafana's dashboard sidecar loads by default) whose JSON is the chart's
// file — the one deploy/dashboards links to — byte for byte.
func TestDashboardConfigMapOptional(t *testing.T) {
	if o := optional(t, "ConfigMap", "ambientd-dashboard", "istio-system"); o != nil {
		t.Fatal("dashboard ConfigMap rendered by default")
	}
	o := optional(t, "ConfigMap", "ambientd-dashboard", "mesh-agents", "ambientd.dashboard.enabled=true")
	if o == nil {
		t.Fatal("dashboard.enabled: no ConfigMap ambientd-dashboard")
	}
	var cm corev1.ConfigMap
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &cm); err != nil {
		t.Fatal(err)
	}
	if cm.Namespace != "mesh-agents" || cm.Labels["grafana_dashboard"] != "1" {
		t.Errorf("ConfigMap in %q labels %v, want mesh-agents with grafana_dashboard=1", cm.Namespace, cm.Labels)
	}
	file, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data["ambientd.json"]; got != strings.TrimSpace(string(file)) {
		t.Errorf("the ConfigMap's ambientd.json is not the chart's %s", dashboardFile)
	}
	if !json.Valid([]byte(cm.Data["ambientd.json"])) {
		t.Error("the ConfigMap's ambientd.json is not JSON")
	}
	if target, err := os.Readlink(filepath.Join(deployDir, "dashboards", "ambientd.json")); err != nil || target != "../helm/ambientd/files/ambientd-dashboard.json" {
		t.Errorf("deploy/dashboards/ambientd.json: link to %q (%v), want the chart's files/ambientd-dashboard.json", target, err)
	}
}

// Every query of the dashboard parses with Prometheus's own parser and
// reads only metrics docs/metrics.md documents (a histogram through its
// _bucket, _sum or _count series) — which the end-to-end suite holds a
// running agent to (TestMetricsDocumented), and the dashboard's own
// end-to-end test checks against the scrape (TestDashboardMetricsExported).
func TestDashboardQueriesReadDocumentedMetrics(t *testing.T) {
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	qs, err := dashboard.Queries(b)
	if err != nil {
		t.Fatal(err)
	}
	documented := documentedMetrics(t)
	panels := map[string]bool{}
	for _, q := range qs {
		panels[q.Panel] = true
		for _, name := range q.Metrics {
			if !documented[name] {
				t.Errorf("%s reads %s, not in docs/metrics.md's reference", q.Panel, name)
			}
		}
	}
	if len(panels) < 10 {
		t.Errorf("only %d panels with queries", len(panels))
	}
}

// documentedMetrics are the series names of docs/metrics.md's reference
// table: each metric, and a histogram's _bucket, _sum and _count.
func documentedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	f, err := os.Open("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	names := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		cells := strings.Split(strings.Trim(sc.Text(), "|"), "|")
		if len(cells) < 2 || !strings.HasPrefix(strings.TrimSpace(cells[0]), "`ambientd_") {
			continue
		}
		name := strings.Trim(strings.TrimSpace(cells[0]), "`")
		names[name] = true
		if strings.TrimSpace(cells[1]) == "histogram" {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				names[name+s] = true
			}
		}
	}
	if len(names) < 10 {
		t.Fatalf("docs/metrics.md: only %d metrics read", len(names))
	}
	return names
}
