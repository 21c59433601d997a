package helm

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/promql/promqltest"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/ambientd/ambientd/test/helm/chartrender"
)

// alertExprs renders the chart's PrometheusRule and returns each alert's
// expression by name.
func alertExprs(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, o := range render(t, chartrender.Options{Set: []string{"ambientd.alerts.enabled=true"}}) {
		if o.GetKind() != "PrometheusRule" {
			continue
		}
		groups, _, _ := unstructured.NestedSlice(o.Object, "spec", "groups")
		for _, g := range groups {
			rules, _, _ := unstructured.NestedSlice(g.(map[string]any), "rules")
			for _, r := range rules {
				r := r.(map[string]any)
				name, _ := r["alert"].(string)
				expr, _ := r["expr"].(string)
				out[name] = expr
			}
		}
	}
	if len(out) == 0 {
		t.Fatal("no alerts rendered")
	}
	return out
}

// TestAlertsParse: every sample alert is valid PromQL.
func TestAlertsParse(t *testing.T) {
	for name, expr := range alertExprs(t) {
		if _, err := parser.NewParser(parser.Options{}).ParseExpr(expr); err != nil {
			t.Errorf("%s: %q: %v", name, expr, err)
		}
	}
}

// TestAlertsFireOnEitherName evaluates the sample alerts (Prometheus's
// own PromQL engine, the alert's condition at one instant; `for` aside)
// against a scrape of ambientd and one of Istio's istio-cni: an alert with
// an Istio twin of its metric (docs/metrics.md, "Istio's names") fires on
// either name, and stays silent on a healthy node of either.
func TestAlertsFireOnEitherName(t *testing.T) {
	exprs := alertExprs(t)
	// Series of 20 one-minute samples (promqltest's load notation);
	// the alert is evaluated at the last one.
	tests := []struct {
		alert, name, series string
		fires               bool
	}{
		{"AmbientdNoZtunnel", "ambientd, no ztunnel", `ambientd_ztunnel_connections{instance="n1"} 0x20`, true},
		{"AmbientdNoZtunnel", "istio-cni, no ztunnel", `ztunnel_connected{instance="n1"} 0x20`, true},
		{"AmbientdNoZtunnel", "ambientd with Istio's names, no ztunnel", `ambientd_ztunnel_connections{instance="n1"} 0x20
  ztunnel_connected{instance="n1"} 0x20`, true},
		{"AmbientdNoZtunnel", "ambientd, connected", `ambientd_ztunnel_connections{instance="n1"} 1x20
  ztunnel_connected{instance="n1"} 1x20`, false},
		{"AmbientdNoZtunnel", "istio-cni, connected", `ztunnel_connected{instance="n1"} 1x20`, false},
		{"AmbientdCNIPluginMissing", "ambientd, plugin missing", `ambientd_cni_plugin_installed{instance="n1"} 0x20`, true},
		{"AmbientdCNIPluginMissing", "istio-cni, plugin missing", `istio_cni_install_ready{instance="n1"} 0x20`, true},
		{"AmbientdCNIPluginMissing", "istio-cni, installed", `istio_cni_install_ready{instance="n1"} 1x20`, false},
		{"AmbientdCNIPluginMissing", "ambientd, installed", `ambientd_cni_plugin_installed{instance="n1"} 1x20
  istio_cni_install_ready{instance="n1"} 1x20`, false},
		{"AmbientdCNIAddErrors", "ambientd, ADDs failing", `ambientd_cni_add_total{instance="n1",outcome="error"} 0+60x20`, true},
		{"AmbientdCNIAddErrors", "istio-cni, ADDs failing", `istio_cni_plugin_requests_total{instance="n1",response_code="500"} 0+60x20`, true},
		{"AmbientdCNIAddErrors", "istio-cni, ADDs answered 200", `istio_cni_plugin_requests_total{instance="n1",response_code="200"} 0+60x20
  istio_cni_plugin_requests_total{instance="n1",response_code="500"} 0x20`, false},
		{"AmbientdCNIAddErrors", "ambientd, ADDs enrolled", `ambientd_cni_add_total{instance="n1",outcome="enrolled"} 0+60x20
  ambientd_cni_add_total{instance="n1",outcome="error"} 0x20
  istio_cni_plugin_requests_total{instance="n1",response_code="200"} 0+60x20`, false},
	}
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1 << 20, Timeout: time.Minute})
	at := time.Unix(0, 0).Add(19 * time.Minute)
	for _, tt := range tests {
		t.Run(tt.alert+"/"+tt.name, func(t *testing.T) {
			expr, ok := exprs[tt.alert]
			if !ok {
				t.Fatalf("no alert %s in the chart", tt.alert)
			}
			st := promqltest.LoadedStorage(t, "load 1m\n  "+tt.series+"\n")
			q, err := engine.NewInstantQuery(context.Background(), st, nil, expr, at)
			if err != nil {
				t.Fatalf("%q: %v", expr, err)
			}
			defer q.Close()
			res := q.Exec(context.Background())
			if res.Err != nil {
				t.Fatalf("%q: %v", expr, res.Err)
			}
			v, err := res.Vector()
			if err != nil {
				t.Fatal(err)
			}
			if fired := len(v) > 0; fired != tt.fires {
				t.Errorf("%s fired = %v (%v), want %v\nexpr: %s", tt.alert, fired, v, tt.fires, expr)
			}
		})
	}
}
