package dashboard

import (
	"slices"
	"strings"
	"testing"
)

// A query's metric names are the ones its selectors read, through
// functions, aggregations and binary operators, with Grafana's interval
// variables in place; a histogram quantile reads the _bucket series. A
// query that does not parse or reads a series without a name is an error
// naming its panel, so a broken panel cannot pass for one reading nothing.
func TestQueriesReadsEveryPanelsMetrics(t *testing.T) {
	for _, tt := range []struct {
		name, dash string
		want       map[string][]string // panel -> names
		err        string
	}{
		{
			name: "selectors through functions, rows and variables",
			dash: `{"panels":[
				{"type":"row","title":"r","panels":[
					{"title":"nested","targets":[{"expr":"sum by (le) (rate(a_bucket{instance=~\"$instance\"}[$__rate_interval]))"}]}]},
				{"title":"two","targets":[
					{"expr":"histogram_quantile(0.99, sum by (le) (rate(b_seconds_bucket[${__rate_interval}])))"},
					{"expr":"count(c == 0) or vector(0) + on() {__name__=\"d\"}"}]}],
				"templating":{"list":[{"name":"instance","type":"query","query":{"query":"label_values(e, instance)"}},
					{"name":"datasource","type":"datasource","query":"prometheus"}]}}`,
			want: map[string][]string{
				`panel "nested"`:      {"a_bucket"},
				`panel "two"`:         {"b_seconds_bucket", "c", "d"},
				`variable "instance"`: {"e"},
			},
		},
		{name: "a query that does not parse", dash: `{"panels":[{"title":"bad","targets":[{"expr":"sum(rate(x[5m])"}]}]}`, err: `panel "bad"`},
		{name: "a selector without a name", dash: `{"panels":[{"title":"nameless","targets":[{"expr":"{job=\"x\"}"}]}]}`, err: "names no metric"},
		{name: "a query reading nothing", dash: `{"panels":[{"title":"const","targets":[{"expr":"vector(1)"}]}]}`, err: "reads no metric"},
		{name: "a variable that is not label_values", dash: `{"templating":{"list":[{"name":"v","type":"query","query":"up"}]}}`, err: `variable "v"`},
		{name: "not JSON", dash: `{`, err: "dashboard:"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			qs, err := Queries([]byte(tt.dash))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want one naming %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := map[string][]string{}
			for _, q := range qs {
				got[q.Panel] = append(got[q.Panel], q.Metrics...)
			}
			for p := range got {
				slices.Sort(got[p])
			}
			if len(got) != len(tt.want) {
				t.Fatalf("queries by panel %v, want %v", got, tt.want)
			}
			for p, w := range tt.want {
				if !slices.Equal(got[p], w) {
					t.Errorf("%s: %v, want %v", p, got[p], w)
				}
			}
		})
	}
}
