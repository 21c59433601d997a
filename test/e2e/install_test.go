//go:build e2e

package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestAgentInstallCNI runs bin/ambientd with --install-cni against a
// temporary host CNI tree: it installs the plugin and its entry; stopped
// while its DaemonSet exists and selects the node (an upgrade) it leaves them
// in place; stopped after the DaemonSet is deleted it uninstalls, leaving the
// primary's config byte-identical.
func TestAgentInstallCNI(t *testing.T) {
	ctx := testContext(t, 3*time.Minute)
	admin := testEnv.CP.Admin
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	primary := "{\n  \"cniVersion\": \"1.0.0\",\n  \"name\": \"k8s-pod-network\",\n  \"plugins\": [\n    {\"type\": \"calico\", \"mtu\": 1440},\n    {\"type\": \"portmap\", \"capabilities\": {\"portMappings\": true}}\n  ]\n}\n"
	confPath := filepath.Join(confDir, "10-calico.conflist")
	if err := os.WriteFile(confPath, []byte(primary), 0o600); err != nil {
		t.Fatal(err)
	}
	installed := func() bool {
		b, err := os.ReadFile(confPath)
		if err != nil || !strings.Contains(string(b), `"type": "ambientd-cni"`) {
			return false
		}
		_, err = os.Stat(filepath.Join(binDir, "ambientd-cni"))
		return err == nil
	}
	start := func(name string) *e2eenv.Agent {
		a, err := testEnv.StartAgent(ctx, e2eenv.AgentConfig{Name: name, Args: []string{
			"--install-cni", "--cni-bin-dir=" + binDir, "--cni-conf-dir=" + confDir,
			"--cni-bin-source=" + testEnv.Bins.CNIPlugin, "--daemonset-namespace=" + e2eenv.AgentNamespace,
		}})
		if err != nil {
			t.Fatal(err)
		}
		a.LogOnFailure(t)
		t.Cleanup(func() { _ = a.Stop(10 * time.Second) })
		// Live: the process is past start-up (signals handled, installer running).
		if err := a.WaitLive(ctx); err != nil {
			t.Fatalf("%s not live: %v", name, err)
		}
		testutil.Eventually(t, name+" installed the plugin", time.Minute, installed)
		return a
	}

	// The DaemonSet from deploy/ exists and selects this node (its
	// nodeSelector kubernetes.io/os=linux matches the environment's node).
	var ds *unstructured.Unstructured
	for _, o := range renderDeploy(t) {
		if o.GetKind() == "DaemonSet" {
			ds = o
		}
	}
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	if err := serverSideApply(ctx, dyn, mapper, ds, false); err != nil {
		t.Fatalf("creating the DaemonSet: %v", err)
	}
	t.Cleanup(func() {
		_ = admin.AppsV1().DaemonSets(ds.GetNamespace()).Delete(context.Background(), ds.GetName(), metav1.DeleteOptions{})
	})

	a := start("agent-install-1")
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if !installed() {
		t.Fatalf("stopping with the DaemonSet in place (an upgrade) removed the plugin:\n%s", a.LogTail(30))
	}
	if !strings.Contains(a.Logs(), "leaving the CNI plugin") {
		t.Errorf("agent did not log its upgrade decision:\n%s", a.LogTail(30))
	}

	a = start("agent-install-2")
	if err := admin.AppsV1().DaemonSets(ds.GetNamespace()).Delete(ctx, ds.GetName(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "DaemonSet gone", time.Minute, func() bool {
		_, err := admin.AppsV1().DaemonSets(ds.GetNamespace()).Get(ctx, ds.GetName(), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(confPath); string(b) != primary {
		t.Fatalf("after uninstall-on-delete the config is\n%s\nwant the original\n%s\nagent log:\n%s", b, primary, a.LogTail(30))
	}
	if _, err := os.Stat(filepath.Join(binDir, "ambientd-cni")); !os.IsNotExist(err) {
		t.Fatalf("plugin binary left after uninstall-on-delete: %v", err)
	}
}
