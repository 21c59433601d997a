// Package dashboard reads the metric names a Grafana dashboard's queries
// use, with Prometheus's own PromQL parser: every panel's targets (rows'
// nested panels too) and every query variable's label_values(). The
// dashboard's tests (test/helm) and the end-to-end test that checks the
// names against a running agent's scrape (test/e2e, through
// cmd/dashboard-metrics) read the chart's dashboard through it.
package dashboard

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

// Query is one PromQL query of the dashboard and the metric names it reads.
type Query struct {
	Panel   string   `json:"panel"` // the panel's title, or "variable NAME"
	Expr    string   `json:"expr"`
	Metrics []string `json:"metrics"` // sorted, each once
}

// panel is the part of Grafana's panel model read here.
type panel struct {
	Title   string  `json:"title"`
	Type    string  `json:"type"`
	Panels  []panel `json:"panels"` // a row's (collapsed) panels
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

type model struct {
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// grafanaVars are Grafana's built-in interval variables, replaced by a
// duration before parsing (they stand where PromQL takes one). Dashboard
// variables of our own appear only inside label matchers' strings.
var grafanaVars = strings.NewReplacer(
	"${__rate_interval}", "5m", "$__rate_interval", "5m",
	"${__interval}", "1m", "$__interval", "1m",
	"${__range}", "1h", "$__range", "1h",
)

// labelValues is Grafana's variable query label_values(selector, label).
var labelValues = regexp.MustCompile(`^\s*label_values\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$`)

// Queries returns every query of the dashboard JSON b. An error names the
// panel and query that did not parse, or that reads a series without a
// metric name (a dashboard query must say what it reads).
func Queries(b []byte) ([]Query, error) {
	var m model
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("dashboard: %w", err)
	}
	var out []Query
	var errs []error
	add := func(where, expr string) {
		names, err := Metrics(expr)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %q: %w", where, expr, err))
			return
		}
		out = append(out, Query{Panel: where, Expr: expr, Metrics: names})
	}
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, t := range p.Targets {
				add(fmt.Sprintf("panel %q", p.Title), t.Expr)
			}
			walk(p.Panels)
		}
	}
	walk(m.Panels)
	for _, v := range m.Templating.List {
		if v.Type != "query" {
			continue
		}
		expr, err := variableQuery(v.Query)
		if err != nil {
			errs = append(errs, fmt.Errorf("variable %q: %w", v.Name, err))
			continue
		}
		add(fmt.Sprintf("variable %q", v.Name), expr)
	}
	return out, errors.Join(errs...)
}

// variableQuery is the series selector of a query variable's
// label_values(selector, label); Grafana stores the query as a string or
// as {"query": "..."}.
func variableQuery(raw json.RawMessage) (string, error) {
	var q string
	if err := json.Unmarshal(raw, &q); err != nil {
		var obj struct{ Query string }
		if err := json.Unmarshal(raw, &obj); err != nil {
			return "", fmt.Errorf("query %s: neither a string nor {query: ...}", raw)
		}
		q = obj.Query
	}
	m := labelValues.FindStringSubmatch(q)
	if m == nil {
		return "", fmt.Errorf("query %q: want label_values(selector, label)", q)
	}
	return m[1], nil
}

// Metrics parses one PromQL expression (Grafana's interval variables
// replaced) and returns the metric names its selectors read, sorted.
func Metrics(expr string) ([]string, error) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(grafanaVars.Replace(expr))
	if err != nil {
		return nil, err
	}
	var names []string
	var errs []error
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		if name == "" {
			for _, lm := range vs.LabelMatchers {
				if lm.Name == labels.MetricName && lm.Type == labels.MatchEqual {
					name = lm.Value
				}
			}
		}
		if name == "" {
			errs = append(errs, fmt.Errorf("selector %s names no metric", vs))
			return nil
		}
		names = append(names, name)
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if len(names) == 0 {
		return nil, errors.New("reads no metric")
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}
