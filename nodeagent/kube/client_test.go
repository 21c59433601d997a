package kube_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/test/infra/kubetest"
)

// request is what an API server sees of one request.
type request struct {
	Method, URL, Accept, ContentType, UserAgent, Body string
}

// recorder is an HTTP server that records requests and answers each with
// an empty object of the kind its path names (JSON).
type recorder struct {
	mu   sync.Mutex
	reqs []request
}

// kinds maps a resource to its kind.
var kinds = map[string]string{"pods": "Pod", "namespaces": "Namespace", "nodes": "Node", "events": "Event", "daemonsets": "DaemonSet"}

func (r *recorder) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	r.mu.Lock()
	r.reqs = append(r.reqs, request{req.Method, req.URL.String(), req.Header.Get("Accept"), req.Header.Get("Content-Type"), req.Header.Get("User-Agent"), string(body)})
	r.mu.Unlock()
	if req.URL.Query().Get("watch") == "true" {
		w.Header().Set("Content-Type", "application/json")
		return // an empty stream: the watch ends at once
	}
	// /api/v1/namespaces/NS/RESOURCE[/NAME[/SUB]] or /apis/GROUP/VERSION/...
	parts := strings.Split(strings.Trim(req.URL.Path, "/"), "/")
	apiVersion, rest := "v1", parts[2:]
	if parts[0] == "apis" {
		apiVersion, rest = parts[1]+"/"+parts[2], parts[3:]
	}
	if len(rest) > 2 && rest[0] == "namespaces" && kinds[rest[2]] != "" {
		rest = rest[2:]
	}
	kind := kinds[rest[0]]
	if len(rest) == 1 && req.Method == http.MethodGet {
		kind += "List"
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"kind":%q,"apiVersion":%q,"metadata":{}}`, kind, apiVersion)
}

func (r *recorder) take() []request {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.reqs
	r.reqs = nil
	return out
}

// TestSameRequestsAsClientset: every call the agent makes sends the API
// server the same request — method, URL with query, Accept (protobuf
// preferred where client-go's generated clients prefer it), Content-Type,
// User-Agent and body — through kube.Client as through client-go's
// Clientset, and the Event sink the same as client-go's EventSinkImpl.
func TestSameRequestsAsClientset(t *testing.T) {
	srv := &recorder{}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	cfg := &rest.Config{Host: ts.URL, UserAgent: "ambientd/test", QPS: 1000, Burst: 1000}

	lean, err := kube.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	full, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	patch := []byte(`{"metadata":{"annotations":{"a":"b"}}}`)
	ev := &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "web.1", Namespace: "app", ResourceVersion: "7"}, Reason: "EnrollmentPending", Count: 1}
	calls := []struct {
		name string
		do   func(c kube.Interface) error
	}{
		{"get pod", func(c kube.Interface) error {
			_, err := c.CoreV1().Pods("app").Get(ctx, "web", metav1.GetOptions{})
			return err
		}},
		{"list pods of a node", func(c kube.Interface) error {
			_, err := c.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=n1", ResourceVersion: "0"})
			return err
		}},
		{"watch pods", func(c kube.Interface) error {
			w, err := c.CoreV1().Pods("").Watch(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=n1", ResourceVersion: "5", AllowWatchBookmarks: true})
			if err == nil {
				w.Stop()
			}
			return err
		}},
		{"patch pod status", func(c kube.Interface) error {
			_, err := c.CoreV1().Pods("app").Patch(ctx, "web", types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
			return err
		}},
		{"get namespace", func(c kube.Interface) error {
			_, err := c.CoreV1().Namespaces().Get(ctx, "app", metav1.GetOptions{})
			return err
		}},
		{"list namespaces", func(c kube.Interface) error {
			_, err := c.CoreV1().Namespaces().List(ctx, metav1.ListOptions{Limit: 500})
			return err
		}},
		{"get node", func(c kube.Interface) error {
			_, err := c.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
			return err
		}},
		{"patch node status", func(c kube.Interface) error {
			_, err := c.CoreV1().Nodes().Patch(ctx, "n1", types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
			return err
		}},
		{"patch node taints (JSON patch)", func(c kube.Interface) error {
			_, err := c.CoreV1().Nodes().Patch(ctx, "n1", types.JSONPatchType, []byte(`[{"op":"test","path":"/spec/taints","value":[]}]`), metav1.PatchOptions{})
			return err
		}},
		{"get daemonset", func(c kube.Interface) error {
			_, err := c.AppsV1().DaemonSets("istio-system").Get(ctx, "ambientd", metav1.GetOptions{})
			return err
		}},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			if err := c.do(kubetest.Wrap(full)); err != nil {
				t.Fatalf("through the Clientset: %v", err)
			}
			want := srv.take()
			if err := c.do(lean); err != nil {
				t.Fatalf("through kube.Client: %v", err)
			}
			compare(t, srv.take(), want)
		})
	}

	sinks := []struct {
		name string
		do   func(record.EventSink) error
	}{
		{"create Event", func(s record.EventSink) error { _, err := s.Create(ev); return err }},
		{"update Event", func(s record.EventSink) error { _, err := s.Update(ev); return err }},
		{"patch Event", func(s record.EventSink) error { _, err := s.Patch(ev, []byte(`{"count":2}`)); return err }},
	}
	for _, c := range sinks {
		t.Run(c.name, func(t *testing.T) {
			if err := c.do(&typedcorev1.EventSinkImpl{Interface: full.CoreV1().Events("")}); err != nil {
				t.Fatalf("through client-go's EventSinkImpl: %v", err)
			}
			want := srv.take()
			if err := c.do(kube.EventSink{Client: lean.CoreV1()}); err != nil {
				t.Fatalf("through kube.EventSink: %v", err)
			}
			compare(t, srv.take(), want)
		})
	}
}

func compare(t *testing.T, got, want []request) {
	t.Helper()
	if len(want) != 1 {
		t.Fatalf("the reference client sent %d requests, want 1: %+v", len(want), want)
	}
	if len(got) != 1 || got[0] != want[0] {
		t.Fatalf("kube sent\n  %+v\nclient-go sent\n  %+v", got, want[0])
	}
	if want[0].UserAgent != "ambientd/test" {
		t.Fatalf("User-Agent %q, want the config's", want[0].UserAgent)
	}
}

func TestNewForConfigRejectsQPSWithoutBurst(t *testing.T) {
	if _, err := kube.NewForConfig(&rest.Config{Host: "http://127.0.0.1:1", QPS: 5}); err == nil || !strings.Contains(err.Error(), "burst") {
		t.Fatalf("NewForConfig with QPS and no burst: %v, want an error naming burst", err)
	}
}
