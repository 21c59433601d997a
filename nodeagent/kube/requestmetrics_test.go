package kube

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestRequestKind(t *testing.T) {
	for _, c := range []struct {
		method, path, watch string
		verb, resource      string
	}{
		{"GET", "/api/v1/namespaces/shop/pods/web", "", "get", "pods"},
		{"GET", "/api/v1/pods", "", "list", "pods"},
		{"GET", "/api/v1/pods", "true", "watch", "pods"},
		{"GET", "/api/v1/namespaces", "1", "watch", "namespaces"},
		{"GET", "/api/v1/namespaces/shop", "", "get", "namespaces"},
		{"PATCH", "/api/v1/namespaces/shop/pods/web/status", "", "patch", "pods/status"},
		{"PATCH", "/api/v1/nodes/n1/status", "", "patch", "nodes/status"},
		{"POST", "/api/v1/namespaces/default/events", "", "create", "events"},
		{"POST", "/api/v1/namespaces/istio-system/serviceaccounts/ambientd-cni/token", "", "create", "serviceaccounts/token"},
		{"GET", "/apis/apps/v1/namespaces/istio-system/daemonsets/ambientd", "", "get", "daemonsets"},
		{"DELETE", "/api/v1/namespaces/shop/pods", "", "deletecollection", "pods"},
		{"GET", "/healthz", "", "get", ""},
	} {
		verb, res := RequestKind(c.method, c.path, c.watch)
		if verb != c.verb || res != c.resource {
			t.Errorf("%s %s watch=%q = %s %s, want %s %s", c.method, c.path, c.watch, verb, res, c.verb, c.resource)
		}
	}
}

// Every request through the wrapped transport is counted by verb, resource
// and code, and in the last minute's count.
func TestRequestMetricsCount(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/missing") {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte(`{"kind":"Node"}`))
	}))
	defer srv.Close()
	m := NewRequestMetrics()
	reg := prometheus.NewRegistry()
	if err := m.Register(reg); err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Transport: m.Wrap(http.DefaultTransport)}
	for _, p := range []string{"/api/v1/nodes/n1", "/api/v1/nodes/n1", "/api/v1/namespaces/a/pods/missing"} {
		resp, err := c.Get(srv.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if got := testutil.ToFloat64(m.requests.WithLabelValues("get", "nodes", "200")); got != 2 {
		t.Errorf("get nodes 200 = %v, want 2", got)
	}
	if got := testutil.ToFloat64(m.requests.WithLabelValues("get", "pods", "404")); got != 1 {
		t.Errorf("get pods 404 = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.bytes.WithLabelValues("get", "nodes")); got != 2*float64(len(`{"kind":"Node"}`)) {
		t.Errorf("bytes read of get nodes = %v, want two answers' worth", got)
	}
	if n := m.LastMinute(time.Now()); n != 3 {
		t.Errorf("last minute = %d, want 3", n)
	}
	if n := m.LastMinute(time.Now().Add(2 * time.Minute)); n != 0 {
		t.Errorf("two minutes later the last minute = %d, want 0", n)
	}
}
