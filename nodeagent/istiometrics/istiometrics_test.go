package istiometrics

import (
	"bytes"
	"errors"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
)

// scrape gathers reg into name → label value (of the one label, or "") →
// value, and name → type.
func scrape(t *testing.T, reg *prometheus.Registry) (map[string]map[string]float64, map[string]string) {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	vals, types := map[string]map[string]float64{}, map[string]string{}
	for _, f := range fams {
		types[f.GetName()] = f.GetType().String()
		vals[f.GetName()] = map[string]float64{}
		for _, m := range f.GetMetric() {
			label := ""
			if ls := m.GetLabel(); len(ls) == 1 {
				label = ls[0].GetName() + "=" + ls[0].GetValue()
			}
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
			vals[f.GetName()][label] = v
		}
	}
	return vals, types
}

// TestNamesTypesLabels: Istio's names, types and label values, every value
// at 0 from the start, each count landing on its own value.
func TestNamesTypesLabels(t *testing.T) {
	m := New()
	reg := prometheus.NewRegistry()
	conns := 0
	var installErr error
	if err := m.Register(reg, Sources{ZtunnelConnections: func() int { return conns }, PluginInstalled: func() error { return installErr }, Installer: true}); err != nil {
		t.Fatal(err)
	}
	vals, types := scrape(t, reg)
	wantTypes := map[string]string{
		"istio_cni_plugin_requests_total":  "COUNTER",
		"nodeagent_reconcile_events_total": "COUNTER",
		"istio_cni_installs_total":         "COUNTER",
		"ztunnel_connected":                "GAUGE",
		"istio_cni_install_ready":          "GAUGE",
	}
	if !maps.Equal(types, wantTypes) {
		t.Fatalf("exported %v, want %v", types, wantTypes)
	}
	zero := map[string]map[string]float64{
		"istio_cni_plugin_requests_total":  {"response_code=200": 0, "response_code=400": 0, "response_code=500": 0},
		"nodeagent_reconcile_events_total": {"type=add": 0, "type=update": 0, "type=delete": 0},
		"istio_cni_installs_total":         {"result=SUCCESS": 0, "result=COPY_BINARIES_FAILURE": 0, "result=CREATE_KUBECONFIG_FAILURE": 0, "result=CREATE_CNI_CONFIG_FAILURE": 0},
		"ztunnel_connected":                {"": 0},
		"istio_cni_install_ready":          {"": 1},
	}
	if !maps.EqualFunc(vals, zero, maps.Equal) {
		t.Fatalf("at start %v, want %v", vals, zero)
	}

	m.PluginRequest(http.StatusOK)
	m.PluginRequest(http.StatusOK)
	m.PluginRequest(http.StatusInternalServerError)
	m.ReconcileEvent(EventUpdate)
	m.ReconcileEvent(EventDelete)
	m.Install(InstallSuccess)
	m.Install(InstallCreateCNIConfigFailure)
	conns, installErr = 2, errors.New("our entry is not in the config")
	vals, _ = scrape(t, reg)
	want := map[string]map[string]float64{
		"istio_cni_plugin_requests_total":  {"response_code=200": 2, "response_code=400": 0, "response_code=500": 1},
		"nodeagent_reconcile_events_total": {"type=add": 0, "type=update": 1, "type=delete": 1},
		"istio_cni_installs_total":         {"result=SUCCESS": 1, "result=COPY_BINARIES_FAILURE": 0, "result=CREATE_KUBECONFIG_FAILURE": 0, "result=CREATE_CNI_CONFIG_FAILURE": 1},
		"ztunnel_connected":                {"": 2},
		"istio_cni_install_ready":          {"": 0},
	}
	if !maps.EqualFunc(vals, want, maps.Equal) {
		t.Errorf("after counting %v, want %v", vals, want)
	}
}

// TestWithoutInstaller: no installer, no istio_cni_installs_total (nothing
// installs); no sources, no gauges.
func TestWithoutInstaller(t *testing.T) {
	reg := prometheus.NewRegistry()
	if err := New().Register(reg, Sources{}); err != nil {
		t.Fatal(err)
	}
	_, types := scrape(t, reg)
	want := map[string]string{"istio_cni_plugin_requests_total": "COUNTER", "nodeagent_reconcile_events_total": "COUNTER"}
	if !maps.Equal(types, want) {
		t.Errorf("exported %v, want %v", types, want)
	}
}

// TestOff: a nil Metrics (the names turned off) counts and registers
// nothing.
func TestOff(t *testing.T) {
	var m *Metrics
	m.PluginRequest(http.StatusOK)
	m.ReconcileEvent(EventAdd)
	m.Install(InstallSuccess)
	reg := prometheus.NewRegistry()
	if err := m.Register(reg, Sources{ZtunnelConnections: func() int { return 1 }, Installer: true}); err != nil {
		t.Fatal(err)
	}
	if _, types := scrape(t, reg); len(types) != 0 {
		t.Errorf("off, yet exported %v", types)
	}
}

// istioExposition is Istio's own exposition of its istio-cni metrics,
// generated with Istio's code (test/istio-oracle/cmd/istio-cni-metrics,
// `make istio-oracle`).
const istioExposition = "../../test/istio-oracle/testdata/metrics/istio-cni.prom"

// family is one metric family of a text exposition: its type, and per
// label name the values its samples show.
type family struct {
	typ    string
	labels map[string][]string
}

// parseFamilies reads a Prometheus text exposition (TYPE lines and
// samples; no histograms).
func parseFamilies(t *testing.T, text string) map[string]*family {
	t.Helper()
	out := map[string]*family{}
	for _, l := range strings.Split(text, "\n") {
		if rest, ok := strings.CutPrefix(l, "# TYPE "); ok {
			name, typ, _ := strings.Cut(rest, " ")
			out[name] = &family{typ: typ, labels: map[string][]string{}}
			continue
		}
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		name, rest, _ := strings.Cut(l, "{")
		name, _, _ = strings.Cut(name, " ")
		f := out[name]
		if f == nil {
			t.Fatalf("sample before its TYPE: %q", l)
		}
		if labels, _, ok := strings.Cut(rest, "}"); ok {
			for _, kv := range strings.Split(labels, ",") {
				k, v, _ := strings.Cut(kv, "=")
				f.labels[k] = append(f.labels[k], strings.Trim(v, `"`))
			}
		}
	}
	return out
}

// TestMatchesIstiosExposition: every family Istio's own code exposes
// (Istio's exporter over Istio's declarations, moved by Istio's installer
// and node agent) is exported by us under the same name, of the same type,
// with the same label names, and every label value Istio showed is one of
// ours.
func TestMatchesIstiosExposition(t *testing.T) {
	golden, err := os.ReadFile(istioExposition)
	if err != nil {
		t.Fatal(err)
	}
	istio := parseFamilies(t, string(golden))
	if len(istio) < 3 {
		t.Fatalf("%s: %d families, want Istio's installer's and node agent's", istioExposition, len(istio))
	}
	m := New()
	reg := prometheus.NewRegistry()
	if err := m.Register(reg, Sources{ZtunnelConnections: func() int { return 0 }, PluginInstalled: func() error { return nil }, Installer: true}); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if _, err := expfmt.MetricFamilyToText(&buf, f); err != nil {
			t.Fatal(err)
		}
	}
	ours := parseFamilies(t, buf.String())
	for name, want := range istio {
		got, ok := ours[name]
		if !ok {
			t.Errorf("Istio exposes %s; we do not", name)
			continue
		}
		if got.typ != want.typ {
			t.Errorf("%s: type %s, Istio's %s", name, got.typ, want.typ)
		}
		if !slices.Equal(slices.Sorted(maps.Keys(got.labels)), slices.Sorted(maps.Keys(want.labels))) {
			t.Errorf("%s: labels %v, Istio's %v", name, slices.Sorted(maps.Keys(got.labels)), slices.Sorted(maps.Keys(want.labels)))
		}
		for label, values := range want.labels {
			for _, v := range values {
				if !slices.Contains(got.labels[label], v) {
					t.Errorf("%s: Istio shows %s=%q, we never export it (ours: %v)", name, label, v, got.labels[label])
				}
			}
		}
	}
}
