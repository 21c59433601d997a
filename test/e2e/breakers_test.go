//go:build e2e

package e2e

// End-to-end test of `ambientd check --cluster-breakers` against a real
// kube-apiserver: Cilium's and kube-proxy's ConfigMaps and Calico's
// FelixConfiguration (its CRD installed as Calico installs it) created as
// the real objects, read by bin/ambientd with a kubeconfig.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"

	"github.com/ambientd/ambientd/breakers"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

var (
	crdGVR   = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	felixGVR = breakers.FelixConfigurations[1] // crd.projectcalico.org/v1
)

// felixCRD is the least of Calico's FelixConfiguration CRD: cluster
// scoped, crd.projectcalico.org/v1, spec kept as given.
func felixCRD() *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
		"metadata": map[string]any{"name": "felixconfigurations.crd.projectcalico.org"},
		"spec": map[string]any{
			"group": "crd.projectcalico.org", "scope": "Cluster",
			"names": map[string]any{"kind": "FelixConfiguration", "listKind": "FelixConfigurationList", "plural": "felixconfigurations", "singular": "felixconfiguration"},
			"versions": []any{map[string]any{
				"name": "v1", "served": true, "storage": true,
				"schema": map[string]any{"openAPIV3Schema": map[string]any{
					"type": "object",
					"properties": map[string]any{
						"spec": map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true},
					},
				}},
			}},
		},
	}}
}

// runBreakers runs `ambientd check --cluster-breakers -o json` with
// kubeconfig and returns its exit code and report.
func runBreakers(t *testing.T, ctx context.Context, kubeconfig string) (int, breakers.Report) {
	t.Helper()
	cmd := exec.CommandContext(ctx, testEnv.Bins.Agent, "check", "--cluster-breakers", "-o", "json", "--kubeconfig", kubeconfig)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("ambientd check --cluster-breakers: %v", err)
	}
	var r breakers.Report
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("ambientd check --cluster-breakers (exit %d): %v\nstdout %s\nstderr %s", code, err, out, stderr.String())
	}
	return code, r
}

func settingsOf(r breakers.Report, breaker bool) []string {
	var s []string
	for _, f := range r.Findings {
		if f.Breaker == breaker {
			s = append(s, f.Component+" "+f.Setting)
		}
	}
	return s
}

// TestClusterBreakers: with Cilium exclusive and load-balancing at the
// socket in pods, and Calico's eBPF connect-time load balancing on,
// `ambientd check --cluster-breakers` names each breaker with its fix and
// exits 3; once each is fixed as its fix says (Calico's with the patch the
// output prints), it finds none and exits 0; kube-proxy's mode is reported;
// absent objects and a user without rights (the agent's own identity) get
// notes, not a failure.
func TestClusterBreakers(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	admin := testEnv.CP.Admin
	dyn, err := dynamic.NewForConfig(testEnv.CP.AdminConfig)
	if err != nil {
		t.Fatal(err)
	}

	// Nothing installed: three notes, no finding, exit 0.
	code, r := runBreakers(t, ctx, testEnv.CP.AdminKubeconfig)
	if code != 0 || len(r.Findings) != 0 || len(r.Notes) != 3 {
		t.Fatalf("nothing installed: exit %d, findings %+v, notes %q; want 0, none, three", code, r.Findings, r.Notes)
	}

	cms := admin.CoreV1().ConfigMaps("kube-system")
	for _, cm := range []*corev1.ConfigMap{
		{ObjectMeta: metav1.ObjectMeta{Name: breakers.CiliumConfigMap}, Data: map[string]string{
			"cni-exclusive": "true", "bpf-lb-sock": "true", "enable-bpf-masquerade": "false", "kube-proxy-replacement": "true",
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: breakers.KubeProxyConfigMap}, Data: map[string]string{
			"config.conf": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n",
		}},
	} {
		if _, err := cms.Create(ctx, cm, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cms.Delete(context.Background(), cm.Name, metav1.DeleteOptions{}) })
	}
	crd := felixCRD()
	if _, err := dyn.Resource(crdGVR).Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dyn.Resource(crdGVR).Delete(context.Background(), crd.GetName(), metav1.DeleteOptions{}) })
	felix := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "crd.projectcalico.org/v1", "kind": "FelixConfiguration",
		"metadata": map[string]any{"name": breakers.FelixConfigurationName},
		"spec":     map[string]any{"bpfEnabled": true, "bpfConnectTimeLoadBalancing": "TCP"},
	}}
	// The CRD serves its resource once established.
	if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := dyn.Resource(felixGVR).Create(ctx, felix, metav1.CreateOptions{})
		return err == nil, nil
	}); err != nil {
		t.Fatalf("creating FelixConfiguration default: %v", err)
	}

	code, r = runBreakers(t, ctx, testEnv.CP.AdminKubeconfig)
	wantBreakers := []string{
		"Cilium cni-exclusive=true",
		"Cilium bpf-lb-sock=true without bpf-lb-sock-hostns-only=true",
		"Calico bpfConnectTimeLoadBalancing=TCP",
	}
	if got := settingsOf(r, true); code != 3 || !slices.Equal(got, wantBreakers) {
		t.Errorf("breakers: exit %d, %q; want exit 3, %q", code, got, wantBreakers)
	}
	if got := settingsOf(r, false); !slices.Equal(got, []string{"kube-proxy mode=ipvs"}) {
		t.Errorf("facts %q; want kube-proxy mode=ipvs", got)
	}
	var calicoFix string
	for _, f := range r.Findings {
		if f.Component == "Calico" {
			calicoFix = f.Fix
			if f.Source != "FelixConfiguration default (crd.projectcalico.org/v1)" {
				t.Errorf("Calico source %q", f.Source)
			}
		}
	}
	if len(r.Notes) != 0 {
		t.Errorf("notes %q; want none (the Calico API server's absence is not worth one when the CRD answered)", r.Notes)
	}

	// Fix each as the output says: Cilium's keys, Calico's printed patch.
	if _, err := cms.Update(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: breakers.CiliumConfigMap}, Data: map[string]string{
		"cni-exclusive": "false", "bpf-lb-sock": "true", "bpf-lb-sock-hostns-only": "true", "enable-bpf-masquerade": "false", "kube-proxy-replacement": "true",
	}}, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	patch := regexp.MustCompile(`-p '([^']+)'`).FindStringSubmatch(calicoFix)
	if patch == nil {
		t.Fatalf("Calico's fix %q holds no kubectl patch", calicoFix)
	}
	if _, err := dyn.Resource(felixGVR).Patch(ctx, breakers.FelixConfigurationName, types.MergePatchType, []byte(patch[1]), metav1.PatchOptions{}); err != nil {
		t.Fatalf("Calico's fix %s: %v", patch[1], err)
	}
	code, r = runBreakers(t, ctx, testEnv.CP.AdminKubeconfig)
	if got := settingsOf(r, true); code != 0 || len(got) != 0 {
		t.Errorf("after the fixes: exit %d, breakers %q; want 0 and none", code, got)
	}
	if got := settingsOf(r, false); len(got) != 3 {
		t.Errorf("after the fixes: facts %q; want Cilium's, Calico's and kube-proxy's", got)
	}

	// The agent's identity may read none of it: notes, exit 0.
	code, r = runBreakers(t, ctx, testEnv.CP.AgentKubeconfig)
	if code != 0 || len(r.Findings) != 0 || len(r.Notes) != 3 {
		t.Fatalf("without rights: exit %d, findings %+v, notes %q; want 0, none, three", code, r.Findings, r.Notes)
	}
	for _, n := range r.Notes {
		if !strings.Contains(n, "Forbidden") {
			t.Errorf("note %q does not say the read was forbidden", n)
		}
	}
}

// ciliumExclusive acts as Cilium's agent with cni-exclusive=true does
// (daemon/cmd/cni/config.go): it writes 05-cilium.conflist and renames
// every other .conf, .conflist and .json of dir to NAME.cilium_bak, again
// whenever one appears, until ctx ends. Follows cilium/cilium's
// cleanupOtherCNI as read at commit 01990e1cc062. Does not emulate: the
// cilium-cni plugin (its conflist names a type no pod runs here), chaining
// modes, the rename of the legacy 05-cilium.conf, and its fsnotify watch
// (it polls every 20 ms instead).
func ciliumExclusive(ctx context.Context, dir string) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		cilium := filepath.Join(dir, "05-cilium.conflist")
		for ctx.Err() == nil {
			if _, err := os.Stat(cilium); err != nil {
				_ = os.WriteFile(cilium, []byte(`{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni"}]}`), 0o644)
			}
			entries, _ := os.ReadDir(dir)
			for _, e := range entries {
				n := e.Name()
				if n == "05-cilium.conflist" || e.IsDir() || !(strings.HasSuffix(n, ".conf") || strings.HasSuffix(n, ".conflist") || strings.HasSuffix(n, ".json")) {
					continue
				}
				_ = os.Rename(filepath.Join(dir, n), filepath.Join(dir, n+".cilium_bak"))
			}
			select {
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return done
}

// TestNodeConditionNamesExclusiveCNI: on a node whose Cilium runs with
// cni-exclusive=true and keeps renaming the agent's config away, the
// node condition is False with reason ExclusiveCNI and a message naming
// the renamed config and the fix — not a bare PluginNotInstalled.
func TestNodeConditionNamesExclusiveCNI(t *testing.T) {
	root := t.TempDir()
	binDir, confDir := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "etc/cni/net.d")
	for _, d := range []string{binDir, confDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(confDir, "10-calico.conflist"), []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	s := newScenario(t, "exclusive", within(2*time.Minute), agentArgs("--install-cni", "--cni-bin-dir="+binDir, "--cni-conf-dir="+confDir,
		"--cni-bin-source="+testEnv.Bins.CNIPlugin, "--daemonset-namespace="+e2eenv.AgentNamespace))
	waitNode(t, s.ctx, testEnv.NodeName, "condition True with the plugin installed", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))

	ctx, stop := context.WithCancel(s.ctx)
	done := ciliumExclusive(ctx, confDir)
	t.Cleanup(func() { stop(); <-done })
	n := waitNode(t, s.ctx, testEnv.NodeName, "condition False/ExclusiveCNI", conditionIs(corev1.ConditionFalse, nodeready.ReasonExclusiveCNI))
	msg := nodeCondition(n).Message
	for _, want := range []string{"00-ambientd.conflist", "cilium_bak", "cni.exclusive=false"} {
		if !strings.Contains(msg, want) {
			t.Errorf("condition message %q lacks %q", msg, want)
		}
	}
	stop()
	<-done
}
