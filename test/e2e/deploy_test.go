//go:build e2e

package e2e

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/ambientd/ambientd/nodeagent/cniinstall"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// renderDeploy renders deploy/ as `kubectl apply -k deploy/` would.
func renderDeploy(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	res, err := k.Run(filesys.MakeFsOnDisk(), filepath.Join(testEnv.Root, "deploy"))
	if err != nil {
		t.Fatalf("kustomize deploy/: %v", err)
	}
	var out []*unstructured.Unstructured
	for _, r := range res.Resources() {
		m, err := r.Map()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, &unstructured.Unstructured{Object: m})
	}
	return out
}

// TestDeployDryRunApply: `kubectl apply --server-side --dry-run=server -k
// deploy/`, through client-go, against the real kube-apiserver: every object
// of the kustomized manifests is accepted (schema, defaulting, validation,
// CEL of the admission policy compiled by the server).
func TestDeployDryRunApply(t *testing.T) {
	ctx := testContext(t, 2*time.Minute)
	objs := renderDeploy(t)
	kinds := map[string]bool{}
	for _, o := range objs {
		kinds[o.GetKind()] = true
	}
	for _, k := range []string{"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "ConfigMap", "DaemonSet"} {
		if !kinds[k] {
			t.Errorf("kustomized deploy/ has no %s", k)
		}
	}
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, o := range objs {
		if o.GetKind() == "DaemonSet" {
			img := o.Object["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)["image"]
			if img != "ghcr.io/ambientd/ambientd:dev" {
				t.Errorf("DaemonSet image %v: the kustomization's images: entry did not apply", img)
			}
		}
		if err := serverSideApply(ctx, dyn, mapper, o, true); err != nil {
			t.Errorf("server-side dry-run apply of %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
}

func dynamicClient(t *testing.T, cfg *rest.Config) (dynamic.Interface, meta.RESTMapper) {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dyn, restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
}

func serverSideApply(ctx context.Context, dyn dynamic.Interface, mapper meta.RESTMapper, o *unstructured.Unstructured, dryRun bool) error {
	gvk := o.GroupVersionKind()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return fmt.Errorf("mapping %s: %w", gvk, err)
	}
	data, err := o.MarshalJSON()
	if err != nil {
		return err
	}
	opts := metav1.PatchOptions{FieldManager: "ambientd-e2e", Force: ptr(true)}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		ri = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
	}
	_, err = ri.Patch(ctx, o.GetName(), types.ApplyPatchType, data, opts)
	return err
}

func ptr[T any](v T) *T { return &v }

// TestDeployAgentRights impersonates the DaemonSet's service account, with
// the node-name extra a bound token carries, against deploy/'s RBAC and its
// admission policy (really created for this test): it can do everything the
// agent does, and is refused pod deletion, secret reads, any change to
// another node, and changes to its own node beyond taints and conditions.
func TestDeployAgentRights(t *testing.T) {
	ctx := testContext(t, 3*time.Minute)
	admin := testEnv.CP.Admin
	var saName string
	var vap *unstructured.Unstructured
	var vapBinding *unstructured.Unstructured
	for _, o := range renderDeploy(t) {
		switch o.GetKind() {
		case "DaemonSet":
			spec, _, _ := unstructured.NestedString(o.Object, "spec", "template", "spec", "serviceAccountName")
			saName = "system:serviceaccount:" + o.GetNamespace() + ":" + spec
		case "ValidatingAdmissionPolicy":
			if o.GetName() == "ambientd-own-node-only" { // deploy/ has a pod policy too
				vap = o
			}
		case "ValidatingAdmissionPolicyBinding":
			if o.GetName() == "ambientd-own-node-only" {
				vapBinding = o
			}
		}
	}
	if saName != e2eenv.AgentUser || vap == nil || vapBinding == nil {
		t.Fatalf("deploy/: DaemonSet runs as %q (environment's agent is %q), policy %v, binding %v", saName, e2eenv.AgentUser, vap != nil, vapBinding != nil)
	}
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, o := range []*unstructured.Unstructured{vap, vapBinding} {
		if err := serverSideApply(ctx, dyn, mapper, o, false); err != nil {
			t.Fatalf("creating %s: %v", o.GetKind(), err)
		}
	}
	// The policy is for this test only: the environment's agent uses a
	// static token without a node name, which the policy would refuse.
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(c, vapBinding.GetName(), metav1.DeleteOptions{})
		_ = admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(c, vap.GetName(), metav1.DeleteOptions{})
		// Removal is asynchronous too: wait until the environment's agent
		// may patch its node again, so later tests do not see the policy.
		testutil.Eventually(t, "admission policy gone", time.Minute, func() bool {
			_, err := testEnv.CP.Agent.CoreV1().Nodes().Patch(c, testEnv.NodeName, types.MergePatchType, []byte(`{}`), metav1.PatchOptions{})
			return err == nil
		})
	})

	suffix := fmt.Sprint(time.Now().UnixNano() % 1e9)
	mine, other := "rights-a-"+suffix, "rights-b-"+suffix
	for _, n := range []string{mine, other} {
		if _, err := e2eenv.CreateNode(ctx, admin, n, []corev1.Taint{{Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule}}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = admin.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{}) })
	}
	nsName := "rights-" + suffix
	if _, err := testEnv.CreateNamespace(ctx, nsName, nil); err != nil {
		t.Fatal(err)
	}
	pod, err := admin.CoreV1().Pods(nsName).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec:       corev1.PodSpec{NodeName: mine, Containers: []corev1.Container{{Name: "c", Image: "x"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Secrets(nsName).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	agent := impersonate(t, mine)
	unbound := impersonate(t, "")
	removeTaint := []byte(`{"spec":{"taints":null}}`)
	setCondition := func(status string) []byte {
		return []byte(fmt.Sprintf(`{"status":{"conditions":[{"type":"AmbientReady","status":%q,"reason":"E2E","message":"rights check"}]}}`, status))
	}
	patchNode := func(c kubernetes.Interface, name, sub string, body []byte) error {
		var err error
		if sub == "" {
			_, err = c.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, body, metav1.PatchOptions{})
		} else {
			_, err = c.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, body, metav1.PatchOptions{}, sub)
		}
		return err
	}

	// The policy loads asynchronously: wait until it refuses a foreign node.
	testutil.Eventually(t, "admission policy in force", time.Minute, func() bool {
		return isDenied(patchNode(agent, other, "", []byte(`{"spec":{"taints":[{"key":"probe","effect":"NoSchedule"}]}}`)))
	})

	// Everything the agent does.
	allowed := map[string]error{}
	_, allowed["list pods"] = agent.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + mine})
	_, allowed["watch namespaces"] = agent.CoreV1().Namespaces().Watch(ctx, metav1.ListOptions{})
	_, allowed["get pod"] = agent.CoreV1().Pods(nsName).Get(ctx, pod.Name, metav1.GetOptions{})
	_, allowed["patch pod annotation"] = agent.CoreV1().Pods(nsName).Patch(ctx, pod.Name, types.MergePatchType, []byte(`{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}`), metav1.PatchOptions{})
	_, allowed["patch pod condition"] = agent.CoreV1().Pods(nsName).Patch(ctx, pod.Name, types.StrategicMergePatchType, []byte(`{"status":{"conditions":[{"type":"ambient.istio.io/enrolled","status":"True"}]}}`), metav1.PatchOptions{}, "status")
	_, allowed["create event"] = agent.CoreV1().Events(nsName).Create(ctx, &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: "ambientd-"},
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: nsName, Name: pod.Name, UID: pod.UID},
		Reason:         "E2E", Message: "rights check", Type: corev1.EventTypeNormal,
	}, metav1.CreateOptions{})
	_, allowed["get own node"] = agent.CoreV1().Nodes().Get(ctx, mine, metav1.GetOptions{})
	allowed["remove own node's taint"] = patchNode(agent, mine, "", removeTaint)
	allowed["set own node's condition"] = patchNode(agent, mine, "status", setCondition("True"))
	if _, err := agent.AppsV1().DaemonSets(e2eenv.AgentNamespace).Get(ctx, "ambientd", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		allowed["get daemonset"] = err // nil would also do; only a refusal is wrong
	}
	for what, err := range allowed {
		if err != nil {
			t.Errorf("agent %s: %v (the agent needs it)", what, err)
		}
	}
	if n, err := admin.CoreV1().Nodes().Get(ctx, mine, metav1.GetOptions{}); err != nil || len(n.Spec.Taints) != 0 || !hasCondition(n, "AmbientReady") {
		t.Errorf("own node after the agent's patches: taints %v, conditions %v (%v)", n.Spec.Taints, n.Status.Conditions, err)
	}

	// Refused by RBAC.
	forbidden := map[string]error{}
	forbidden["delete pod"] = agent.CoreV1().Pods(nsName).Delete(ctx, pod.Name, metav1.DeleteOptions{})
	_, forbidden["get secret"] = agent.CoreV1().Secrets(nsName).Get(ctx, "s", metav1.GetOptions{})
	_, forbidden["list secrets"] = agent.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
	forbidden["delete node"] = agent.CoreV1().Nodes().Delete(ctx, mine, metav1.DeleteOptions{})
	for what, err := range forbidden {
		if !apierrors.IsForbidden(err) {
			t.Errorf("agent %s: %v, want forbidden", what, err)
		}
	}
	// Refused by the admission policy.
	denied := map[string]error{
		"taint another node":           patchNode(agent, other, "", removeTaint),
		"condition on another node":    patchNode(agent, other, "status", setCondition("False")),
		"label own node":               patchNode(agent, mine, "", []byte(`{"metadata":{"labels":{"x":"y"}}}`)),
		"annotate own node":            patchNode(agent, mine, "", []byte(`{"metadata":{"annotations":{"x":"y"}}}`)),
		"cordon own node":              patchNode(agent, mine, "", []byte(`{"spec":{"unschedulable":true}}`)),
		"change own node's addresses":  patchNode(agent, mine, "status", []byte(`{"status":{"addresses":[{"type":"InternalIP","address":"10.9.9.9"}]}}`)),
		"patch a node without binding": patchNode(unbound, mine, "status", setCondition("False")),
	}
	for what, err := range denied {
		if !isDenied(err) {
			t.Errorf("agent may %s (err %v): the admission policy must refuse it", what, err)
		}
	}
	if n, _ := admin.CoreV1().Nodes().Get(ctx, other, metav1.GetOptions{}); len(n.Spec.Taints) == 0 {
		t.Error("the other node's taint is gone")
	}
}

// impersonate is a client acting as the DaemonSet's service account; node,
// when set, is the node-name extra the kubelet's bound token carries.
func impersonate(t *testing.T, node string) kubernetes.Interface {
	t.Helper()
	cfg := rest.CopyConfig(testEnv.CP.AdminConfig)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: e2eenv.AgentUser,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + e2eenv.AgentNamespace, "system:authenticated"},
	}
	if node != "" {
		cfg.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// isDenied: the admission policy's refusal (Invalid or Forbidden, with the
// policy named), not some other error.
func isDenied(err error) bool {
	var se *apierrors.StatusError
	if !errors.As(err, &se) {
		return false
	}
	return (apierrors.IsInvalid(err) || apierrors.IsForbidden(err)) && strings.Contains(err.Error(), "ambientd-own-node-only")
}

func hasCondition(n *corev1.Node, typ string) bool {
	for _, c := range n.Status.Conditions {
		if string(c.Type) == typ {
			return true
		}
	}
	return false
}

// TestUninstallOnShutdownRule reads a real DaemonSet (deploy/'s, created
// for real) with the agent's own rights: present and selecting the node →
// upgrade (leave everything); being deleted → uninstall; gone → uninstall.
func TestUninstallOnShutdownRule(t *testing.T) {
	ctx := testContext(t, 2*time.Minute)
	admin := testEnv.CP.Admin
	var ds *unstructured.Unstructured
	for _, o := range renderDeploy(t) {
		if o.GetKind() == "DaemonSet" {
			ds = o
		}
	}
	if ds == nil {
		t.Fatal("no DaemonSet in deploy/")
	}
	nsName := "shutdown-" + fmt.Sprint(time.Now().UnixNano()%1e9)
	if _, err := testEnv.CreateNamespace(ctx, nsName, nil); err != nil {
		t.Fatal(err)
	}
	ds.SetNamespace(nsName)
	ds.SetFinalizers([]string{"e2e.ambientd.io/hold"}) // keeps it "being deleted" until removed
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	if err := serverSideApply(ctx, dyn, mapper, ds, false); err != nil {
		t.Fatalf("creating the DaemonSet: %v", err)
	}
	rule := func() (bool, string) {
		t.Helper()
		u, reason, err := cniinstall.UninstallOnShutdown(ctx, testEnv.CP.Agent, nsName, ds.GetName(), testEnv.NodeName)
		if err != nil {
			t.Fatalf("UninstallOnShutdown with the agent's rights: %v", err)
		}
		return u, reason
	}
	if u, reason := rule(); u {
		t.Fatalf("DaemonSet present: uninstall (%s), want leave in place", reason)
	}
	if err := admin.AppsV1().DaemonSets(nsName).Delete(ctx, ds.GetName(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if u, reason := rule(); !u || !strings.Contains(reason, "being deleted") {
		t.Fatalf("DaemonSet being deleted: uninstall=%v (%s)", u, reason)
	}
	if _, err := admin.AppsV1().DaemonSets(nsName).Patch(ctx, ds.GetName(), types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "DaemonSet gone", time.Minute, func() bool {
		_, err := admin.AppsV1().DaemonSets(nsName).Get(ctx, ds.GetName(), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if u, reason := rule(); !u || !strings.Contains(reason, "gone") {
		t.Fatalf("DaemonSet gone: uninstall=%v (%s)", u, reason)
	}
}
