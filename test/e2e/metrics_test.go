//go:build e2e

package e2e

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// documentedMetric is one row of docs/metrics.md's reference table.
type documentedMetric struct {
	name, typ, source string
	labels            []string
	values            []string // of the first label; nil when open ("*") or none
}

// readMetricsDoc parses the reference table of docs/metrics.md, the one
// source of the metric names, types, labels and label values.
func readMetricsDoc(t *testing.T) []documentedMetric {
	t.Helper()
	return readMetricsTable(t, "## Reference", 6, 10)
}

// readMetricsTable parses the table under heading of docs/metrics.md
// (rows of cells cells, the first five: name, type, labels, values of
// the first label, source); fewer than min rows fail the test.
func readMetricsTable(t *testing.T, heading string, cellCount, minRows int) []documentedMetric {
	t.Helper()
	f, err := os.Open(filepath.Join(testEnv.Root, "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	split := func(s string) []string {
		var out []string
		for _, v := range strings.Split(s, ",") {
			if v = strings.TrimSpace(v); v != "" {
				out = append(out, v)
			}
		}
		return out
	}
	var out []documentedMetric
	sc := bufio.NewScanner(f)
	inTable := false
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			inTable = line == heading // the table ends at the next heading
		}
		if !inTable || !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) != cellCount {
			t.Fatalf("docs/metrics.md: row with %d cells, want %d: %s", len(cells), cellCount, line)
		}
		m := documentedMetric{
			name:   strings.Trim(strings.TrimSpace(cells[0]), "`"),
			typ:    strings.TrimSpace(cells[1]),
			labels: split(cells[2]),
			source: strings.TrimSpace(cells[4]),
		}
		if v := strings.TrimSpace(cells[3]); v != "*" {
			m.values = split(v)
		}
		out = append(out, m)
	}
	if len(out) < minRows {
		t.Fatalf("docs/metrics.md: only %d metrics parsed under %q", len(out), heading)
	}
	return out
}

// scrapedFamily is one metric family of a /metrics scrape.
type scrapedFamily struct {
	typ     string
	samples []map[string]string // label sets, without le / quantile
}

var sampleRe = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? `)
var labelRe = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// parseExposition reads Prometheus text format into families by name
// (histogram series folded into their family).
func parseExposition(text string) map[string]*scrapedFamily {
	fams := map[string]*scrapedFamily{}
	for _, l := range strings.Split(text, "\n") {
		if rest, ok := strings.CutPrefix(l, "# TYPE "); ok {
			name, typ, _ := strings.Cut(rest, " ")
			fams[name] = &scrapedFamily{typ: typ}
			continue
		}
		m := sampleRe.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		name := m[1]
		f := fams[name]
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if base, ok := strings.CutSuffix(name, suf); ok && fams[base] != nil && fams[base].typ == "histogram" {
				f = fams[base]
			}
		}
		if f == nil {
			continue
		}
		labels := map[string]string{}
		for _, lm := range labelRe.FindAllStringSubmatch(m[2], -1) {
			if lm[1] != "le" && lm[1] != "quantile" {
				labels[lm[1]] = lm[2]
			}
		}
		f.samples = append(f.samples, labels)
	}
	return fams
}

// checkDocumented checks a scrape (fams) against documented metrics: each
// present when its source is in always (else logged), of its type, with
// exactly its labels, with values of the first label from the documented
// set, and every documented value exported when its source is in
// everyValue. It returns the documented names.
func checkDocumented(t *testing.T, fams map[string]*scrapedFamily, docs []documentedMetric, always, everyValue map[string]bool) map[string]bool {
	t.Helper()
	documented := map[string]bool{}
	for _, d := range docs {
		documented[d.name] = true
		f, ok := fams[d.name]
		if !ok || len(f.samples) == 0 {
			if always[d.source] {
				t.Errorf("%s (source %s) is documented but not exported", d.name, d.source)
			} else {
				t.Logf("%s: source %s not wired in this agent; not exported", d.name, d.source)
			}
			continue
		}
		if f.typ != d.typ {
			t.Errorf("%s: type %s, documented %s", d.name, f.typ, d.typ)
		}
		seen := map[string]bool{}
		for _, s := range f.samples {
			var names []string
			for k := range s {
				names = append(names, k)
			}
			slices.Sort(names)
			want := slices.Sorted(slices.Values(d.labels))
			if !slices.Equal(names, want) {
				t.Errorf("%s: sample labels %v, documented %v", d.name, names, want)
				break
			}
			if len(d.labels) > 0 {
				v := s[d.labels[0]]
				seen[v] = true
				if d.values != nil && !slices.Contains(d.values, v) {
					t.Errorf("%s: %s=%q is not among the documented values %v", d.name, d.labels[0], v, d.values)
				}
			}
		}
		if everyValue[d.source] {
			for _, v := range d.values {
				if !seen[v] {
					t.Errorf("%s: documented %s=%q not exported", d.name, d.labels[0], v)
				}
			}
		}
	}
	return documented
}

// TestMetricsDocumented scrapes a running agent that has enrolled a pod and
// checks every metric docs/metrics.md documents: present (for the parts
// always there), of its type, with exactly its labels, with label values
// from the documented set, and — for the agent's own — every documented
// value exported. Undocumented ambientd_ metrics fail too.
func TestMetricsDocumented(t *testing.T) {
	s := newScenario(t, "metrics")
	ctx, nsName, a := s.ctx, s.ns, s.agent
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "scraped"})
	waitAnnotation(t, ctx, p, "enabled")

	body, err := a.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fams := parseExposition(body)
	docs := readMetricsDoc(t)
	documented := checkDocumented(t, fams, docs, map[string]bool{"agent": true, "ztunnel": true, "api": true}, map[string]bool{"agent": true})
	for name := range fams {
		if strings.HasPrefix(name, "ambientd_") && !documented[name] {
			t.Errorf("%s is exported but not documented in docs/metrics.md", name)
		}
	}
	// The enrollment moved the numbers it should have.
	if v := metricValue(t, ctx, a, "ambientd_enrollments_total", ""); v < 1 {
		t.Errorf("ambientd_enrollments_total = %v after an enrollment", v)
	}
	if v := metricValue(t, ctx, a, "ambientd_pods", `phase="enabled"`); v < 1 {
		t.Errorf(`ambientd_pods{phase="enabled"} = %v with a pod enabled`, v)
	}
	if v := metricValue(t, ctx, a, "ambientd_cni_add_duration_seconds_count", `outcome="enrolled"`); v < 1 {
		t.Errorf(`ambientd_cni_add_duration_seconds_count{outcome="enrolled"} = %v after a CNI ADD`, v)
	}
	// The pod's status write is one of the agent's API requests.
	testutil.Until(t, ctx, "the pod's status write counted", func() bool {
		return metricValue(t, ctx, a, "ambientd_kube_requests_total", `code="200",resource="pods/status",verb="patch"`) >= 1
	})
}

// TestIstioMetricNames runs the agent with --install-cni (a temporary host
// CNI tree) and no ztunnel yet, scrapes it against docs/metrics.md's
// "Istio's names" table (present, type, labels, values), and shows each
// name moving with the event Istio counts: ztunnel_connected 0 → 1 → 0 as
// a ztunnel comes and goes, istio_cni_plugin_requests_total{200} with the
// CNI ADD of a mesh pod (and not with one of a pod out of the mesh),
// nodeagent_reconcile_events_total with pod and namespace events,
// istio_cni_installs_total{SUCCESS} with the install and with a repair
// of the removed config, istio_cni_install_ready. The two time-to-mesh-
// ready histograms get their observations on the way.
func TestIstioMetricNames(t *testing.T) {
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	primary := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico","mtu":1440}]}`
	if err := os.WriteFile(filepath.Join(confDir, "10-calico.conflist"), []byte(primary), 0o600); err != nil {
		t.Fatal(err)
	}
	s := newScenario(t, "istiometrics", withoutZtunnel(), agentArgs(
		"--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace,
	))
	ctx, a := s.ctx, s.agent
	value := func(name, labels string) float64 { return metricValue(t, ctx, a, name, labels) }
	until := func(what string, cond func() bool) {
		t.Helper()
		testutil.Until(t, ctx, what, cond)
	}
	const ok, installed = `response_code="200"`, `result="SUCCESS"`

	// Installed, no ztunnel: every name of the table, as documented.
	until("the plugin installed, counted", func() bool {
		return value("istio_cni_installs_total", installed) >= 1 && value("istio_cni_install_ready", "") == 1
	})
	body, err := a.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fams := parseExposition(body)
	checkDocumented(t, fams, readMetricsTable(t, "## Istio's names", 7, 5),
		map[string]bool{"agent": true, "ztunnel": true, "install-cni": true}, map[string]bool{"agent": true, "install-cni": true})
	if f := fams["ztunnel_connected"]; f == nil || len(f.samples) != 1 || value("ztunnel_connected", "") != 0 {
		t.Fatalf("ztunnel_connected with no ztunnel: %+v, want one sample at 0", f)
	}

	// A ztunnel connects: 0 → 1, and the node gets ready once.
	em := startEmulator(t, ctx, "ztunnel-istiometrics")
	if err := a.WaitReady(ctx); err != nil {
		t.Fatalf("agent not ready with a ztunnel connected: %v\n%s", err, a.LogTail(50))
	}
	if v := value("ztunnel_connected", ""); v != 1 {
		t.Errorf("ztunnel_connected = %v with a ztunnel connected, want 1", v)
	}
	until("the node's time to mesh-ready observed", func() bool { return value("ambientd_node_mesh_ready_seconds_count", "") == 1 })

	// A mesh pod's ADD: one request answered 200, as Istio's agent would
	// count it; the pod's informer events; its time to mesh-ready.
	adds, updates := value("nodeagent_reconcile_events_total", `type="add"`), value("nodeagent_reconcile_events_total", `type="update"`)
	requests := value("istio_cni_plugin_requests_total", ok)
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "meshed"})
	waitAnnotation(t, ctx, p, "enabled")
	if v := value("istio_cni_plugin_requests_total", ok); v != requests+1 {
		t.Errorf(`istio_cni_plugin_requests_total{%s} = %v after one mesh pod's ADD, want %v`, ok, v, requests+1)
	}
	until("the pod's informer events counted", func() bool {
		return value("nodeagent_reconcile_events_total", `type="add"`) > adds && value("nodeagent_reconcile_events_total", `type="update"`) > updates
	})
	until("the pod's time to mesh-ready observed", func() bool { return value("ambientd_pod_mesh_ready_seconds_count", "") == 1 })
	if sum := value("ambientd_pod_mesh_ready_seconds_sum", ""); sum < 0 || sum > time.Minute.Seconds() {
		t.Errorf("pod's time to mesh-ready %vs, want between its creation and now", sum)
	}

	// A pod out of the mesh: its ADD is ambientd's, not one Istio's plugin
	// would send its agent. A new namespace is an add event.
	plain := uniqueNS("istiometrics-plain")
	adds = value("nodeagent_reconcile_events_total", `type="add"`)
	createNamespace(t, ctx, plain, false)
	until("the namespace's add event counted", func() bool { return value("nodeagent_reconcile_events_total", `type="add"`) > adds })
	notInMesh := value("ambientd_cni_add_total", `outcome="not-in-mesh"`)
	createPod(t, ctx, e2eenv.PodSpec{Namespace: plain, Name: "plain"})
	until("the plain pod's ADD answered", func() bool { return value("ambientd_cni_add_total", `outcome="not-in-mesh"`) == notInMesh+1 })
	if v := value("istio_cni_plugin_requests_total", ok); v != requests+1 {
		t.Errorf(`istio_cni_plugin_requests_total{%s} = %v after a plain pod's ADD, want still %v`, ok, v, requests+1)
	}

	// Another writer removes our config: the repair is an install round.
	rounds := value("istio_cni_installs_total", installed)
	if err := os.Remove(filepath.Join(confDir, cniinstall.DefaultOwnedName)); err != nil {
		t.Fatal(err)
	}
	until("the repair counted", func() bool { return value("istio_cni_installs_total", installed) == rounds+1 })
	until("installed again", func() bool { return value("istio_cni_install_ready", "") == 1 })

	// The ztunnel goes: 1 → 0.
	if err := em.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	until("ztunnel_connected back to 0", func() bool { return value("ztunnel_connected", "") == 0 })
	if v := value("istio_cni_installs_total", `result="CREATE_CNI_CONFIG_FAILURE"`) + value("istio_cni_installs_total", `result="COPY_BINARIES_FAILURE"`); v != 0 {
		t.Errorf("%v failed install rounds counted on a healthy node", v)
	}
}

// TestIstioMetricNamesOff: with AMBIENTD_ISTIO_METRICS=false the agent
// exports none of Istio's names but the repair controller's (always its),
// and its own as ever.
func TestIstioMetricNamesOff(t *testing.T) {
	s := newScenario(t, "istiometrics-off", agentEnv("AMBIENTD_ISTIO_METRICS=false"))
	p := createPod(t, s.ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "meshed"})
	waitAnnotation(t, s.ctx, p, "enabled")
	body, err := s.agent.Metrics(s.ctx)
	if err != nil {
		t.Fatal(err)
	}
	fams := parseExposition(body)
	for _, d := range readMetricsTable(t, "## Istio's names", 7, 5) {
		if _, ok := fams[d.name]; ok && d.name != "istio_cni_repair_pods_repaired_total" {
			t.Errorf("%s exported with AMBIENTD_ISTIO_METRICS=false", d.name)
		}
	}
	if v := metricValue(t, s.ctx, s.agent, "ambientd_cni_add_total", `outcome="enrolled"`); v != 1 {
		t.Errorf(`ambientd_cni_add_total{outcome="enrolled"} = %v after one ADD, want 1`, v)
	}
}
