package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/bundle"
	"github.com/ambientd/ambientd/nodeagent/unixsock"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// bundleNode is a node's CNI dirs as the agent sees them: the primary's
// conflist, Calico's kubeconfig beside it, the plugin, its lease and its
// kubeconfig (each kubeconfig with its own token).
type bundleNode struct {
	confDir, binDir, kubeconfig string
	tokens                      []string // every credential placed on the node or in the environment
}

const jwtToken = "eyJhbGciOiJSUzI1NiIsImtpZCI6IngifQ.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2lnbmF0dXJlLWJ5dGVz"

func newBundleNode(t *testing.T) *bundleNode {
	t.Helper()
	root := t.TempDir()
	n := &bundleNode{confDir: filepath.Join(root, "net.d"), binDir: filepath.Join(root, "bin"), kubeconfig: filepath.Join(root, "agent.kubeconfig")}
	kubeconfig := func(token string) string {
		n.tokens = append(n.tokens, token)
		return "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n" +
			"contexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: " + token + "\n"
	}
	n.tokens = append(n.tokens, "conflist-token-7f3a", jwtToken, "env-token-91c2", "env-password-55aa")
	files := map[string]string{
		filepath.Join(n.confDir, "10-calico.conflist"): `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico",` +
			`"kubernetes":{"kubeconfig":"/etc/cni/net.d/calico-kubeconfig"},"policy":{"type":"k8s","token":"conflist-token-7f3a"}}]}`,
		filepath.Join(n.confDir, "calico-kubeconfig"):      kubeconfig("calico-token-2b1d"),
		filepath.Join(n.binDir, "ambientd-cni"):            "\x7fELF plugin",
		filepath.Join(n.binDir, "ambientd-cni.kubeconfig"): kubeconfig("plugin-token-c0de"),
		filepath.Join(n.binDir, "ambientd-cni.lease"):      `{"version":1,"state":"installed","confDir":"/etc/cni/net.d","daemonSetName":"ambientd"}`,
		n.kubeconfig: kubeconfig("agent-token-d00d"),
		filepath.Join(n.confDir, "multus.d", "multus.kubeconfig"): kubeconfig("multus-token-e1e1"),
	}
	// A config that is a link out of the conf dir, to the agent's kubeconfig.
	if err := os.MkdirAll(n.confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(n.kubeconfig, filepath.Join(n.confDir, "20-link.conflist")); err != nil {
		t.Fatal(err)
	}
	for path, data := range files {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

// env is the agent's environment with credentials in it: a variable named
// for a token, a password, a setting whose value is a service account
// token, and KUBECONFIG naming a kubeconfig with a token.
func (n *bundleNode) env(extra ...string) (func(string) string, []string) {
	environ := append([]string{
		"NODE_NAME=node-1",
		"KUBECONFIG=" + n.kubeconfig,
		"AMBIENTD_CNI_CONF_DIR=" + n.confDir,
		"AMBIENTD_CNI_BIN_DIR=" + n.binDir,
		"AMBIENTD_CNI_PLUGIN_SERVICE_ACCOUNT=" + jwtToken,
		"MY_API_TOKEN=env-token-91c2",
		"DB_PASSWORD=env-password-55aa",
	}, extra...)
	m := map[string]string{}
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return func(k string) string { return m[k] }, environ
}

// readBundle returns the archive's files (top directory stripped) and
// its whole decompressed tar stream.
func readBundle(t *testing.T, path string) (map[string]string, []byte) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(gz)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(bytes.NewReader(raw))
	files := map[string]string{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files, raw
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		dir, name, _ := strings.Cut(h.Name, "/")
		if !strings.HasPrefix(dir, "ambientd-bundle-node-1-") {
			t.Errorf("%s: not under the bundle's top directory", h.Name)
		}
		files[name] = string(data)
	}
}

// TestBundleKeepsCredentialsOut is the attack: tokens in the environment
// (by name and by value), in the agent's kubeconfig, the plugin's
// kubeconfig in the CNI bin dir, Calico's and Multus's kubeconfigs in the
// conf dir and a token field inside a conflist never land in the archive
// — while the files around them do.
func TestBundleKeepsCredentialsOut(t *testing.T) {
	n := newBundleNode(t)
	getenv, environ := n.env()
	out := filepath.Join(t.TempDir(), "b.tar.gz")
	var stdout, stderr bytes.Buffer
	args := []string{"-o", out, "--timeout", "20s", "--", "--admin-socket", filepath.Join(t.TempDir(), "none.sock"), "--metrics-addr", "127.0.0.1:1"}
	if code := runBundle(context.Background(), args, getenv, environ, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	fi, err := os.Stat(out)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("archive %v mode %v; want 0600", err, fi.Mode())
	}
	files, raw := readBundle(t, out)
	for _, tok := range n.tokens {
		if bytes.Contains(raw, []byte(tok)) {
			t.Errorf("credential %q is in the archive", tok)
		}
	}
	for _, name := range []string{"cni/conf/calico-kubeconfig", "cni/conf/multus.kubeconfig", "cni/ambientd-cni.kubeconfig"} {
		if _, ok := files[name]; ok {
			t.Errorf("%s collected", name)
		}
	}
	checks := map[string][]string{
		"cni/conf/10-calico.conflist": {`"name":"k8s-pod-network"`, `"token":"[REDACTED]"`},
		"cni/conf-dir.txt":            {"10-calico.conflist", "calico-kubeconfig", "multus.d"},
		"cni/bin-dir.txt":             {"ambientd-cni.kubeconfig", "ambientd-cni.lease"},
		"cni/install-lease.json":      {`"state":"installed"`},
		"env.txt":                     {"KUBECONFIG=" + `"` + n.kubeconfig + `"`, "AMBIENTD_CNI_PLUGIN_SERVICE_ACCOUNT=[REDACTED]", "\nMY_API_TOKEN\n", "\nDB_PASSWORD\n"},
		"settings.txt":                {`--cni-plugin-service-account="[REDACTED]"	(env AMBIENTD_CNI_PLUGIN_SERVICE_ACCOUNT)`, `--node-name="node-1"	(env NODE_NAME)`, `--kubeconfig="` + n.kubeconfig + `"	(env KUBECONFIG)`},
		bundle.ManifestName: {"note      status: agent not running", "note      events.txt: the node's Events:", "note      metrics.txt:",
			"file      cni/conf/10-calico.conflist (", "note      cni/conf/20-link.conflist: a symlink leading out of the conf dir: not followed"},
	}
	for name, wants := range checks {
		for _, want := range wants {
			if !strings.Contains(files[name], want) {
				t.Errorf("%s lacks %q:\n%s", name, want, files[name])
			}
		}
	}
}

// fakeStatus is the admin API's answers for two pods, one with an error
// that quotes a bearer token.
type fakeStatus struct{}

func (fakeStatus) NodeStatus(context.Context) admin.NodeStatus {
	return admin.NodeStatus{Node: "node-1", Time: time.Now(), NotReady: []string{"no ztunnel connected"}, Plugin: "installed", NodeReadiness: "False",
		Pods: []admin.Pod{
			{UID: "u1", Namespace: "shop", Name: "web", Phase: "enabled", Annotation: "enabled", ZtunnelAcked: true},
			{UID: "u2", Namespace: "shop", Name: "cart", Phase: "pending", Annotation: "pending", LastError: "ztunnel refused: upstream said Authorization: Bearer bearer-token-5e5e"},
		}}
}

func (fakeStatus) PodDetail(_ context.Context, ns, name string) (admin.PodDetail, error) {
	return admin.PodDetail{Pod: admin.Pod{Namespace: ns, Name: name}, Rules: "*mangle\n-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff\nCOMMIT\n"}, nil
}

// serveAdmin serves the admin API as the daemon does: a 0600 socket, the
// root-only handler.
func serveAdmin(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ln, _, err := unixsock.Listen(sock, "unix", 0o600)
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: admin.Handler(fakeStatus{}, nil), ConnContext: admin.ConnContext}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	return sock
}

// serveMetrics serves a Prometheus registry on loopback, as the agent's
// --metrics-addr does.
func serveMetrics(t *testing.T) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "ambientd_cni_plugin_installed", Help: "1 when installed."})
	g.Set(1)
	reg.MustRegister(g)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{})}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	return ln.Addr().String()
}

// TestBundleSections: with the agent's admin socket and metrics serving,
// the archive holds every section — version, settings, variables, rules,
// the status and each pod's (with its live rules), the errors, the CNI
// dirs and lease, the metrics — with a bearer token in a pod's error
// redacted; an oversized conflist is cut at --max-file-bytes and the
// whole stays under --max-total-bytes.
func TestBundleSections(t *testing.T) {
	testutil.RequireRoot(t) // the admin socket answers root only
	n := newBundleNode(t)
	big := `{"cniVersion":"1.0.0","name":"huge","plugins":[{"type":"bridge","pad":"` + strings.Repeat("p", 3<<20) + `"}]}`
	if err := os.WriteFile(filepath.Join(n.confDir, "20-huge.conflist"), []byte(big), 0o644); err != nil {
		t.Fatal(err)
	}
	getenv, environ := n.env("AMBIENTD_ADMIN_SOCKET="+serveAdmin(t), "AMBIENTD_METRICS_ADDR="+serveMetrics(t))
	out := filepath.Join(t.TempDir(), "b.tar.gz")
	const maxFile, maxTotal = 64 << 10, 256 << 10
	var stdout, stderr bytes.Buffer
	args := []string{"-o", out, "--max-file-bytes", fmt.Sprint(maxFile), "--max-total-bytes", fmt.Sprint(maxTotal), "--timeout", "20s"}
	if code := runBundle(context.Background(), args, getenv, environ, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	files, raw := readBundle(t, out)
	for _, name := range []string{"version.txt", "settings.txt", "env.txt", "rules/pod-rules.txt", "rules/host-rules.txt", "status.json",
		"pods/shop/web.json", "pods/shop/cart.json", "errors.txt", "cni/conf-dir.txt", "cni/conf/10-calico.conflist", "cni/conf/20-huge.conflist",
		"cni/bin-dir.txt", "cni/install-lease.json", "metrics.txt", bundle.ManifestName} {
		if _, ok := files[name]; !ok {
			t.Errorf("%s missing from the archive", name)
		}
	}
	for name, want := range map[string]string{
		"version.txt":          "ambientd " + version,
		"rules/pod-rules.txt":  "ISTIO_OUTPUT",
		"rules/host-rules.txt": "ISTIO_POSTRT",
		"pods/shop/web.json":   "CONNMARK --set-xmark 0x111/0xfff",
		"errors.txt":           "pod shop/cart (pending): ztunnel refused: upstream said Authorization: Bearer [REDACTED]",
		"metrics.txt":          "ambientd_cni_plugin_installed 1",
		bundle.ManifestName:    "truncated cni/conf/20-huge.conflist (65536 of ",
	} {
		if !strings.Contains(files[name], want) {
			t.Errorf("%s lacks %q:\n%.2000s", name, want, files[name])
		}
	}
	if !strings.Contains(files["errors.txt"], "agent not ready: no ztunnel connected") {
		t.Errorf("errors.txt lacks the agent's not-ready check:\n%s", files["errors.txt"])
	}
	for _, tok := range append(n.tokens, "bearer-token-5e5e") {
		if bytes.Contains(raw, []byte(tok)) {
			t.Errorf("credential %q is in the archive", tok)
		}
	}
	if huge := files["cni/conf/20-huge.conflist"]; len(huge) > maxFile+200 || !strings.Contains(huge, "[ambientd bundle: truncated: 65536 of ") {
		t.Errorf("the oversized conflist is %d bytes in the archive; want it cut at %d with a marker", len(huge), maxFile)
	}
	content := 0
	for name, data := range files {
		if name != bundle.ManifestName {
			c, _, _ := strings.Cut(data, "\n[ambientd bundle: truncated")
			content += len(c)
		}
	}
	if content > maxTotal {
		t.Errorf("%d bytes of files, over --max-total-bytes %d", content, maxTotal)
	}
}

// TestBundleFlags: usage errors exit 2 and write nothing.
func TestBundleFlags(t *testing.T) {
	dir := t.TempDir()
	for _, args := range [][]string{
		{"-o", filepath.Join(dir, "x"), "--max-file-bytes", "10"},
		{"-o", filepath.Join(dir, "x"), "--max-file-bytes", "4096", "--max-total-bytes", "2048"},
		{"-o", filepath.Join(dir, "x"), "--timeout", "0s"},
		{"-o", filepath.Join(dir, "x"), "stray"},
		{"-o", filepath.Join(dir, "x"), "--", "--no-such-agent-flag"},
	} {
		var out, errb bytes.Buffer
		if code := runBundle(context.Background(), args, envMap(), nil, &out, &errb); code != 2 {
			t.Errorf("%q: exit %d (%s), want 2", args, code, errb.String())
		}
		if _, err := os.Stat(filepath.Join(dir, "x")); err == nil {
			t.Fatalf("%q: wrote the archive", args)
		}
	}
}
