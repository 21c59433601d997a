package main

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniapi"
)

// BenchmarkPluginAddNoAgent measures an ADD while no agent answers, for a
// pod outside the mesh: exec of ambientd-cni to its exit, with the socket
// missing, the install lease and kubeconfig read, and the pod and its
// namespace read over TLS (a new connection per exec, as on a node) from
// a stand-in of the API server's answers. Compare with BenchmarkPluginAdd,
// the path with an agent, which reads no file and asks no API.
func BenchmarkPluginAddNoAgent(b *testing.B) {
	podNS := newNS(b)
	api := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/api/v1/namespaces/shop/pods/web-0":
			fmt.Fprint(w, `{"kind":"Pod","apiVersion":"v1","metadata":{"name":"web-0","namespace":"shop","uid":"uid-1"}}`)
		case "/api/v1/namespaces/shop":
			fmt.Fprint(w, `{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"shop"}}`)
		default:
			w.WriteHeader(http.StatusInternalServerError)
		}
	}))
	b.Cleanup(api.Close)
	dir := b.TempDir()
	bin := filepath.Join(dir, "ambientd-cni")
	data, err := os.ReadFile(filepath.Join(binDir, "ambientd-cni"))
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		b.Fatal(err)
	}
	lease, _ := json.Marshal(cniapi.InstallLease{Version: cniapi.LeaseVersion, State: cniapi.LeaseInstalled, Renewed: time.Now(), TTL: "10m",
		ConfDir: dir, DaemonSetNamespace: "istio-system", DaemonSetName: "ambientd", Policy: &cniapi.LeasePolicy{SystemNamespace: "istio-system"}})
	if err := os.WriteFile(bin+cniapi.LeaseSuffix, lease, 0o644); err != nil {
		b.Fatal(err)
	}
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: api.Certificate().Raw})
	kc := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: %q, certificate-authority-data: %q}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n",
		api.URL, base64.StdEncoding.EncodeToString(ca))
	if err := os.WriteFile(bin+cniapi.KubeconfigSuffix, []byte(kc), 0o600); err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(dir, "run", "cni.sock") // nobody listens
	stdin := netconf("1.1.0", fmt.Sprintf(`,"agentSocket":%q`, sock), prevResult(podNS.Path()))
	env := cniEnv("ADD", podNS.Path(), podArgs)
	benchExec(b, func() run { return execBinary(b, bin, env, stdin, nil) })
}
