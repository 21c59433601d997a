//go:build e2e

package e2e

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/bundle"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestBundleFromRunningAgent: `ambientd bundle` next to a running agent
// that installed its plugin (real lease, real plugin kubeconfig holding
// the agent's token) and enrolled a pod collects the pod's status with its
// live rules, the node's Events through the API, the agent's metrics, the
// CNI dirs and the lease — and neither the agent's token (plugin
// kubeconfig) nor the admin's (its kubeconfig, a kubeconfig in the conf
// dir, a variable) lands in the archive.
func TestBundleFromRunningAgent(t *testing.T) {
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	// Both dirs exist, as on a node: the agent creates a missing bin dir
	// only when it first writes the lease, after the plugin's kubeconfig,
	// which then waits for the lease's first renewal (a minute).
	for _, d := range []string{binDir, confDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	primary := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico","kubernetes":{"kubeconfig":"` + confDir + `/calico-kubeconfig"}}]}`
	adminKubeconfig, err := os.ReadFile(testEnv.CP.AdminKubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"10-calico.conflist": []byte(primary), "calico-kubeconfig": adminKubeconfig} {
		if err := os.WriteFile(filepath.Join(confDir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	s := newScenario(t, "bundle", within(3*time.Minute), agentArgs("--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace))
	ctx := s.ctx
	pluginKubeconfig := filepath.Join(binDir, cniapi.PluginType+cniapi.KubeconfigSuffix)
	testutil.Until(t, ctx, "the plugin's kubeconfig written", func() bool {
		b, err := os.ReadFile(pluginKubeconfig)
		return err == nil && bytes.Contains(b, []byte(testEnv.CP.AgentToken))
	})
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "web"})
	waitAnnotation(t, ctx, p, "enabled")
	waitEvents(t, ctx, testEnv.NodeName, nodeready.EventAmbientReady)

	out := filepath.Join(t.TempDir(), "bundle.tar.gz")
	cmd := exec.CommandContext(ctx, testEnv.Bins.Agent, "bundle", "-o", out, "--",
		"--kubeconfig="+testEnv.CP.AdminKubeconfig, "--node-name="+testEnv.NodeName, "--admin-socket="+testEnv.AdminSocket,
		"--metrics-addr="+s.agent.MetricsAddr, "--cni-conf-dir="+confDir, "--cni-bin-dir="+binDir)
	cmd.Env = append(os.Environ(), "CLUSTER_ADMIN_TOKEN="+testEnv.CP.AdminToken, "AMBIENTD_CNI_PLUGIN_SERVICE_ACCOUNT=Bearer "+testEnv.CP.AgentToken)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ambientd bundle: %v\n%s", err, b)
	}
	files, raw := untarBundle(t, out)
	for _, tok := range []string{testEnv.CP.AdminToken, testEnv.CP.AgentToken} {
		if bytes.Contains(raw, []byte(tok)) {
			t.Errorf("a token of this cluster is in the archive")
		}
	}
	for name, want := range map[string]string{
		"status.json":                   `"name": "web"`,
		"pods/" + s.ns + "/web.json":    "ISTIO_",
		"errors.txt":                    "agent: ready",
		"events.txt":                    nodeready.EventAmbientReady,
		"metrics.txt":                   "ambientd_",
		"cni/conf/00-ambientd.conflist": cniapi.PluginType,
		"cni/conf/10-calico.conflist":   "k8s-pod-network",
		"cni/conf-dir.txt":              "calico-kubeconfig",
		"cni/bin-dir.txt":               cniapi.PluginType + cniapi.KubeconfigSuffix,
		"cni/install-lease.json":        `"state":`,
		"settings.txt":                  `--install-cni="false"`, // the agent's flags were not passed: the bundle shows what it was given
		"rules/pod-rules.txt":           "ISTIO_OUTPUT",
		bundle.ManifestName:             "file      events.txt",
		"env.txt":                       "\nCLUSTER_ADMIN_TOKEN\n",
	} {
		if !strings.Contains(files[name], want) {
			t.Errorf("%s lacks %q:\n%.3000s", name, want, files[name])
		}
	}
	if strings.Contains(files[bundle.ManifestName], "note ") {
		t.Errorf("a section was not collected:\n%s", files[bundle.ManifestName])
	}
}

// untarBundle returns the archive's files (top directory stripped) and the
// whole decompressed tar stream.
func untarBundle(t *testing.T, path string) (map[string]string, []byte) {
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
	files := map[string]string{}
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files, raw
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		_, name, _ := strings.Cut(h.Name, "/")
		files[name] = string(b)
	}
}
