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
			inTable = line == "## Reference" // the table ends at the next heading
		}
		if !inTable || !strings.HasPrefix(line, "| `ambientd_") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) != 6 {
			t.Fatalf("docs/metrics.md: row with %d cells, want 6: %s", len(cells), line)
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
	if len(out) < 10 {
		t.Fatalf("docs/metrics.md: only %d metrics parsed", len(out))
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
	documented := map[string]bool{}
	for _, d := range docs {
		documented[d.name] = true
		f, ok := fams[d.name]
		if !ok || len(f.samples) == 0 {
			if d.source == "agent" || d.source == "ztunnel" || d.source == "api" {
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
		if d.source == "agent" {
			for _, v := range d.values {
				if !seen[v] {
					t.Errorf("%s: documented %s=%q not exported", d.name, d.labels[0], v)
				}
			}
		}
	}
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
