//go:build e2e

package e2e

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// dashboardQuery is one query of the chart's Grafana dashboard and the
// metric names it reads, as bin/dashboard-metrics (test/helm's
// cmd/dashboard-metrics: Prometheus's PromQL parser) lists them.
type dashboardQuery struct {
	Panel   string
	Expr    string
	Metrics []string
}

// dashboardQueries runs bin/dashboard-metrics on the chart's dashboard,
// deploy/dashboards/ambientd.json (the file its ConfigMap embeds).
func dashboardQueries(t *testing.T) []dashboardQuery {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(testEnv.Bins.DashboardMetrics, filepath.Join(testEnv.Root, "deploy", "dashboards", "ambientd.json"))
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s: %v: %s", cmd, err, stderr.String())
	}
	var qs []dashboardQuery
	if err := json.Unmarshal(stdout.Bytes(), &qs); err != nil {
		t.Fatal(err)
	}
	if len(qs) < 10 {
		t.Fatalf("the dashboard has only %d queries", len(qs))
	}
	return qs
}

// scrapedSeries are the series names of a /metrics scrape, as PromQL sees
// them: a histogram is its _bucket, _sum and _count series.
func scrapedSeries(body string) map[string]bool {
	names := map[string]bool{}
	for _, l := range strings.Split(body, "\n") {
		if m := sampleRe.FindStringSubmatch(l); m != nil {
			names[m[1]] = true
		}
	}
	return names
}

// TestDashboardMetricsExported: every metric name any panel (or variable)
// of the chart's Grafana dashboard queries is in the scrape of a running
// agent set up as the DaemonSet runs it (--install-cni, so the install
// lease's gauge is there too) that has enrolled a pod. A panel on a metric
// the agent does not export — renamed, removed, or not added yet — would
// show "No data" forever; it fails here instead.
func TestDashboardMetricsExported(t *testing.T) {
	qs := dashboardQueries(t)
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(confDir, "10-calico.conflist"), []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	s := newScenario(t, "dashboard", agentArgs("--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace))
	p := createPod(t, s.ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "charted"})
	waitAnnotation(t, s.ctx, p, "enabled")

	body, err := s.agent.Metrics(s.ctx)
	if err != nil {
		t.Fatal(err)
	}
	scraped := scrapedSeries(body)
	read := 0
	for _, q := range qs {
		for _, name := range q.Metrics {
			read++
			if !scraped[name] {
				t.Errorf("%s reads %s, which the running agent does not export (query %s)", q.Panel, name, q.Expr)
			}
		}
	}
	t.Logf("%d queries, %d metric reads, all in the agent's scrape of %d series names", len(qs), read, len(scraped))
}
