package kubeapi

import (
	"context"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A stand-in for kube-apiserver's answers (v1.37 wire format: JSON objects,
// a metav1.Status with reason NotFound and details.kind the resource on a
// missing object), and a proxy in front of it that answers 404 itself.
func apiServer(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer tok" {
			w.WriteHeader(http.StatusUnauthorized)
			fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}`)
			return
		}
		switch r.URL.Path {
		case "/api/v1/namespaces/shop/pods/web":
			fmt.Fprint(w, `{"kind":"Pod","apiVersion":"v1","metadata":{"name":"web","namespace":"shop","uid":"u1","labels":{"a":"b"}}}`)
		case "/api/v1/namespaces/shop":
			fmt.Fprint(w, `{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"shop","labels":{"istio.io/dataplane-mode":"ambient"}}}`)
		case "/apis/apps/v1/namespaces/istio-system/daemonsets/ambientd":
			fmt.Fprint(w, `{"kind":"DaemonSet","apiVersion":"apps/v1","metadata":{"name":"ambientd","namespace":"istio-system"}}`)
		case "/apis/apps/v1/namespaces/istio-system/daemonsets/gone":
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"daemonsets.apps \"gone\" not found","reason":"NotFound","details":{"name":"gone","group":"apps","kind":"daemonsets"},"code":404}`)
		case "/apis/apps/v1/namespaces/istio-system/daemonsets/proxied":
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `<html>404 page not found</html>`)
		default:
			w.WriteHeader(http.StatusInternalServerError)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// writeKubeconfig writes a kubeconfig for srv (client-go sends a token
// only over TLS).
func writeKubeconfig(t *testing.T, srv *httptest.Server, token string, mode os.FileMode) string {
	t.Helper()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	p := filepath.Join(t.TempDir(), "ambientd-cni.kubeconfig")
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: %q, certificate-authority-data: %q}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`, srv.URL, base64.StdEncoding.EncodeToString(ca), token)
	if err := os.WriteFile(p, []byte(kc), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestReads(t *testing.T) {
	srv := apiServer(t)
	c, err := Load(writeKubeconfig(t, srv, "tok", 0o600))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p, err := c.Pod(ctx, "shop", "web")
	if err != nil || p.UID != "u1" || p.Labels["a"] != "b" {
		t.Fatalf("Pod: %+v, %v", p, err)
	}
	ns, err := c.Namespace(ctx, "shop")
	if err != nil || ns.Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Fatalf("Namespace: %+v, %v", ns, err)
	}
	if gone, err := c.DaemonSetGone(ctx, "istio-system", "ambientd"); gone || err != nil {
		t.Errorf("existing DaemonSet: gone=%v err=%v", gone, err)
	}
	if gone, err := c.DaemonSetGone(ctx, "istio-system", "gone"); !gone || err != nil {
		t.Errorf("the server's NotFound: gone=%v err=%v, want proof", gone, err)
	}
	// A 404 that is not the API server's NotFound of a DaemonSet proves
	// nothing.
	if gone, err := c.DaemonSetGone(ctx, "istio-system", "proxied"); gone || err == nil {
		t.Errorf("a proxy's 404: gone=%v err=%v, want an error", gone, err)
	}
	if _, err := c.Pod(ctx, "shop", "other"); err == nil || errors.Is(err, ErrNotFound) {
		t.Errorf("500: %v", err)
	}
	// The wrong credentials: an error, never NotFound.
	bad, err := Load(writeKubeconfig(t, srv, "stale", 0o600))
	if err != nil {
		t.Fatal(err)
	}
	if gone, err := bad.DaemonSetGone(ctx, "istio-system", "gone"); gone || err == nil || !strings.Contains(err.Error(), "401") {
		t.Errorf("401: gone=%v err=%v", gone, err)
	}
}

// Load refuses credentials anyone but root could have read or written.
func TestLoadRefusesUntrustedFiles(t *testing.T) {
	srv := apiServer(t)
	if _, err := Load(writeKubeconfig(t, srv, "tok", 0o644)); err == nil || !strings.Contains(err.Error(), "open to group or others") {
		t.Errorf("0644 kubeconfig: %v", err)
	}
	good := writeKubeconfig(t, srv, "tok", 0o600)
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(link); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("symlinked kubeconfig: %v", err)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("missing kubeconfig loaded")
	}
	garbage := filepath.Join(t.TempDir(), "garbage")
	if err := os.WriteFile(garbage, []byte("\x00\x01{{{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(garbage); err == nil {
		t.Error("garbage kubeconfig loaded")
	}
}
