// Package helm holds the tests of the Helm chart in deploy/helm/ambientd:
// lint, the values schema, the manifests of deploy/ generated from it, and
// its compatibility with Istio's own `cni` chart, and the sample alerts
// evaluated by Prometheus's PromQL engine (alerts_test.go). Helm's Go engine lives in
// this test-only module, never in the product module.
package helm
