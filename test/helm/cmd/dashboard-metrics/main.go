// Command dashboard-metrics prints, as JSON, every PromQL query of a Grafana
// dashboard and the metric names it reads (package dashboard: Prometheus's
// own parser). The end-to-end test of the chart's dashboard runs it and
// checks each name against a running agent's scrape; it lives in this
// test-only module so that Prometheus's parser stays out of the product's
// go.mod.
//
//	go run ./cmd/dashboard-metrics ../../deploy/dashboards/ambientd.json
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/ambientd/ambientd/test/helm/dashboard"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: dashboard-metrics DASHBOARD.json")
		os.Exit(2)
	}
	b, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	qs, err := dashboard.Queries(b)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(qs); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
