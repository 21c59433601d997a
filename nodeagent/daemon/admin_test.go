package daemon

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ambientd/ambientd/nodeagent/admin"
)

// TestPluginCheck: a configured plugin check is exported as
// ambientd_cni_plugin_installed and as the status's plugin field, live; with
// no check there is neither (status says unknown).
func TestPluginCheck(t *testing.T) {
	var missing error
	cfg := Config{PluginInstalled: func() error { return missing }}
	reg := prometheus.NewRegistry()
	if err := registerPluginCheck(&cfg, reg); err != nil {
		t.Fatal(err)
	}
	status := func() string {
		st := admin.NodeStatus{Plugin: admin.Unknown}
		for _, p := range cfg.StatusProviders {
			p(&st)
		}
		return st.Plugin
	}
	gauge := func(reg *prometheus.Registry) (float64, bool) {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "ambientd_cni_plugin_installed" && len(mf.GetMetric()) == 1 {
				return mf.GetMetric()[0].GetGauge().GetValue(), true
			}
		}
		return 0, false
	}
	if got := status(); got != "installed" {
		t.Errorf("status plugin %q, want installed", got)
	}
	if v, ok := gauge(reg); !ok || v != 1 {
		t.Errorf("gauge %v (exported %v), want 1", v, ok)
	}
	missing = errors.New("conflist has no ambientd-cni entry")
	if got := status(); got != "missing: conflist has no ambientd-cni entry" {
		t.Errorf("status plugin %q, want the check's error", got)
	}
	if v, ok := gauge(reg); !ok || v != 0 {
		t.Errorf("gauge %v (exported %v), want 0", v, ok)
	}

	var none Config
	reg = prometheus.NewRegistry()
	if err := registerPluginCheck(&none, reg); err != nil {
		t.Fatal(err)
	}
	if _, ok := gauge(reg); ok || len(none.StatusProviders) != 0 {
		t.Errorf("without a check: gauge exported %v, %d providers; want neither", ok, len(none.StatusProviders))
	}
}
