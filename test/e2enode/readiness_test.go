//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/build"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// gateConfigName is the name of the chart's gate injection, the
// MutatingAdmissionPolicy or the MutatingWebhookConfiguration.
const gateConfigName = "ambientd-readiness-gate"

// TestReadinessGateWithHelmDefaults: "Ready means meshed" on the node's
// Kubernetes release, installed as docs/install.md says (`helm install`
// with the chart's defaults: only what this node needs is set, the image
// and the apiserver's address). The chart picks how the readiness gate is
// added by the server's version, which helm reads from the apiserver: the
// MutatingAdmissionPolicy from 1.36, the webhook (`ambientd webhook`) before.
// Then, with nothing about the gate in any manifest: a Deployment's pods in
// an ambient namespace get it and are Ready only once ztunnel acked them
// (AdmissionGatesFromPolicy's step, with either mechanism); pods behind a
// Service go NotReady and out of its EndpointSlice when ztunnel is gone,
// back when it returns; `helm uninstall` leaves the node as before.
// `make e2e-node` runs it on the current release with the rest of the
// suite; `make e2e-node-k8s135` runs it alone on Kubernetes 1.35.
func TestReadinessGateWithHelmDefaults(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 10*time.Minute)
	node.RestoredAtCleanup(t, ctx, "the readiness test")
	r := &agentRun{pristine: readPristine(t)}
	t.Cleanup(func() { r.remove(t) })
	h := &helmInstall{}
	t.Cleanup(func() { h.uninstall(t, r) }) // before remove: a failed step's release
	steps := []struct {
		name string
		fn   func(*testing.T, context.Context)
	}{
		{"HelmInstallPicksGateMechanism", func(t *testing.T, ctx context.Context) { h.install(t, ctx, r) }},
		{"DeploymentGatedReadyAfterEnrollment", r.admissionGatesFromPolicy},
		{"ZtunnelGoneDropsEndpoints", func(t *testing.T, ctx context.Context) { r.ztunnelGoneDropsEndpointsOf(t, ctx, nodeenv.AppPod) }},
		{"HelmUninstallLeavesNodeAsBefore", func(t *testing.T, ctx context.Context) { h.uninstallLeavesNodeAsBefore(t, ctx, r) }},
	}
	for _, s := range steps {
		if !t.Run(s.name, func(t *testing.T) {
			t.Cleanup(func() { agentDiagnostics(t) })
			ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
			defer cancel()
			s.fn(t, ctx)
		}) {
			return
		}
	}
}

// helmInstall is the chart's release on the node.
type helmInstall struct {
	bin, home, chart string
	installed        bool
}

// gateMechanism is what the chart's default (auto) picks for a server
// version: the MutatingAdmissionPolicy of admissionregistration.k8s.io/v1
// from Kubernetes 1.36, the webhook before.
func gateMechanism(major, minor string) (string, error) {
	ma, err := strconv.Atoi(major)
	if err != nil {
		return "", fmt.Errorf("server major version %q: %w", major, err)
	}
	mi, err := strconv.Atoi(strings.TrimSuffix(minor, "+"))
	if err != nil {
		return "", fmt.Errorf("server minor version %q: %w", minor, err)
	}
	if ma > 1 || mi >= 36 {
		return "policy", nil
	}
	return "webhook", nil
}

// install runs `helm install` with the chart's defaults, starts ztunnel and
// waits for the agent; then checks that the chart installed the mechanism
// the server's version calls for, and only that one, and waits until it
// adds the gate (a server-side dry run of a gate-less pod in an ambient
// namespace comes back gated: the webhook's replicas are scheduled once the
// agent removed the startup taint, then serve with the CA they made).
func (h *helmInstall) install(t *testing.T, ctx context.Context, r *agentRun) {
	admin := node.Env.CP.Admin
	version, err := admin.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	want, err := gateMechanism(version.Major, version.Minor)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("server version %s (kube-apiserver %s, kubelet %s): the chart should pick the %s", version.GitVersion, node.Bins.KubeAPIServer, node.Bins.Kubelet, want)
	bins, err := build.Ensure(ctx, []build.Part{build.Helm}, build.Options{Log: os.Stderr, Name: "the readiness test"})
	if err != nil {
		t.Fatal(err)
	}
	h.bin, h.home, h.chart = bins.Helm, t.TempDir(), filepath.Join(node.Env.Root, "deploy", "helm", "ambientd")
	if err := node.ImportImage(ctx, agentImageArchive(t)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	// --take-ownership: the environment's control plane starts with
	// deploy/rbac.yaml loaded (its agent identity); a cluster has none of it.
	if _, err := helm(t, ctx, h.bin, h.home, append([]string{"install", "ambientd", h.chart, "-n", "istio-system", "--take-ownership"}, helmNodeValues(t)...)...); err != nil {
		t.Fatal(err)
	}
	h.installed = true
	r.overlay = "helm" // the cleanup deletes the DaemonSet if a step fails
	r.serveAndWaitReady(t, ctx)

	_, policyErr := admin.AdmissionregistrationV1().MutatingAdmissionPolicies().Get(ctx, gateConfigName, metav1.GetOptions{})
	hook, hookErr := admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, gateConfigName, metav1.GetOptions{})
	for _, e := range []error{policyErr, hookErr} {
		if e != nil && !apierrors.IsNotFound(e) {
			t.Fatal(e)
		}
	}
	got := map[bool]string{true: "policy", false: "webhook"}[policyErr == nil]
	if (policyErr == nil) == (hookErr == nil) || got != want {
		t.Fatalf("the chart installed: MutatingAdmissionPolicy %s: %v, MutatingWebhookConfiguration %s: %v; want only the %s on %s",
			gateConfigName, policyErr == nil, gateConfigName, hookErr == nil, want, version.GitVersion)
	}
	if got == "webhook" {
		for _, w := range hook.Webhooks {
			t.Logf("MutatingWebhookConfiguration %s: webhook %s, failurePolicy %v, service %v, namespaceSelector %v",
				hook.Name, w.Name, ptrString(w.FailurePolicy), w.ClientConfig.Service, w.NamespaceSelector)
		}
	}

	ns := ambientNamespace(t, ctx, "gate-dry-run")
	var dry *corev1.Pod
	if err := nodeenv.Poll(ctx, "the "+got+" adds the gate to a dry-run pod", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		dry, err = admin.CoreV1().Pods(ns).Create(ctx, nodeenv.AppPod("dry-run"), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil && hasGate(dry), err
	}); err != nil {
		if got == "webhook" {
			pods, _ := admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "app=ambientd-webhook"})
			t.Logf("webhook pods: %v", describePods(pods.Items))
			logs, _ := node.Kubectl(ctx, "logs", "-n", "istio-system", "deployment/ambientd-webhook", "--tail=100")
			t.Logf("webhook log:\n%s", logs)
		}
		t.Fatal(err)
	}
	r.gate = got
	t.Logf("helm install -> agent Ready, the %s gating pods: %s", got, time.Since(start).Round(time.Millisecond))
	if got == "webhook" {
		pods, err := admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "app=ambientd-webhook"})
		if err != nil {
			t.Fatal(err)
		}
		if n := slices.IndexFunc(pods.Items, func(p corev1.Pod) bool { return p.Spec.HostNetwork }); n >= 0 {
			t.Errorf("webhook pod %s in the host network: the test must reach it over the pod network", pods.Items[n].Name)
		}
		t.Logf("webhook pods: %v", describePods(pods.Items))
	}
}

// uninstallLeavesNodeAsBefore: `helm uninstall`, as docs/install.md gives
// it: the agent's pod goes, the node's CNI conf dir and host rules are as
// before the install, and nothing of the gate injection is left.
func (h *helmInstall) uninstallLeavesNodeAsBefore(t *testing.T, ctx context.Context, r *agentRun) {
	start := time.Now()
	if _, err := helm(t, ctx, h.bin, h.home, "uninstall", "ambientd", "-n", "istio-system", "--cascade", "foreground", "--wait"); err != nil {
		t.Fatal(err)
	}
	h.installed = false
	if err := nodeenv.Poll(ctx, "agent pod gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return p == nil, err
	}); err != nil {
		t.Fatal(err)
	}
	r.overlay = ""
	r.nodeLeftAsBefore(t, ctx)
	admin := node.Env.CP.Admin
	if _, err := admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, gateConfigName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("MutatingWebhookConfiguration %s after the uninstall: %v, want not found", gateConfigName, err)
	}
	if _, err := admin.AdmissionregistrationV1().MutatingAdmissionPolicies().Get(ctx, gateConfigName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("MutatingAdmissionPolicy %s after the uninstall: %v, want not found", gateConfigName, err)
	}
	t.Logf("helm uninstall -> node as before: %s", time.Since(start).Round(time.Millisecond))
}

func ptrString[T ~string](p *T) string {
	if p == nil {
		return "<unset>"
	}
	return string(*p)
}

// uninstall removes a release a failed step left (t's cleanup).
func (h *helmInstall) uninstall(t *testing.T, r *agentRun) {
	if !h.installed {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := helm(t, ctx, h.bin, h.home, "uninstall", "ambientd", "-n", "istio-system", "--cascade", "foreground", "--wait"); err != nil {
		t.Errorf("helm uninstall after a failed step: %v", err)
		return
	}
	r.overlay = ""
}
