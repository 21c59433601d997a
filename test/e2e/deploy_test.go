//go:build e2e

package e2e

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/shutdownrule"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// renderDeploy renders deploy/ as `kubectl apply -k deploy/` would.
func renderDeploy(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	return kustomize(t, filepath.Join(testEnv.Root, "deploy"))
}

// kustomize renders the kustomization in dir.
func kustomize(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
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
	ctx := testutil.Context(t, 2*time.Minute)
	objs := renderDeploy(t)
	kinds := map[string]bool{}
	for _, o := range objs {
		kinds[o.GetKind()] = true
	}
	for _, k := range []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "ConfigMap", "DaemonSet", "FlowSchema", "PriorityLevelConfiguration"} {
		if !kinds[k] {
			t.Errorf("kustomized deploy/ has no %s", k)
		}
	}
	// `kubectl delete -k deploy/` deletes what the kustomization holds: a
	// Namespace there would take istio-system, and Istio, with it.
	if kinds["Namespace"] {
		t.Error("kustomized deploy/ holds a Namespace: uninstalling would delete it")
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

// deleteObject deletes o (the resource its kind maps to).
func deleteObject(ctx context.Context, dyn dynamic.Interface, mapper meta.RESTMapper, o *unstructured.Unstructured) error {
	gvk := o.GroupVersionKind()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return fmt.Errorf("mapping %s: %w", gvk, err)
	}
	var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		ri = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
	}
	return ri.Delete(ctx, o.GetName(), metav1.DeleteOptions{})
}

func ptr[T any](v T) *T { return &v }

// isDenied: the admission policy's refusal (Invalid or Forbidden, with the
// policy named), not some other error.
func isDenied(err error) bool {
	var se *apierrors.StatusError
	if !errors.As(err, &se) {
		return false
	}
	return (apierrors.IsInvalid(err) || apierrors.IsForbidden(err)) && strings.Contains(err.Error(), "ambientd-own-node-only")
}

// TestUninstallOnShutdownRule reads a real DaemonSet (deploy/'s, created
// for real) with the agent's own identity (a pod-bound token of deploy/'s
// ServiceAccount, installed with a name prefix), the rule watching it as the
// running agent does: present and selecting the node → upgrade (leave
// everything). The agent pod force-deleted (its bound token dies with it:
// 401) while the DaemonSet stays → keep: a replacement is coming, and
// removing the plugin under it would let ambient pods start uncaptured.
// Then what `kubectl delete -k deploy/` does, in its order, back to back,
// to a replacement agent: the binding deleted (403), the ServiceAccount
// deleted (401), the DaemonSet deleted → uninstall, because the watch
// opened before the identity went still delivers the deletion. An identity that never could
// read the DaemonSet → keep (a refusal proves nothing). Namespace being
// deleted, DaemonSet being deleted, DaemonSet gone → uninstall.
func TestUninstallOnShutdownRule(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	admin := testEnv.CP.Admin
	daemonSet := func() *unstructured.Unstructured {
		for _, o := range renderDeploy(t) {
			if o.GetKind() == "DaemonSet" {
				return o
			}
		}
		t.Fatal("no DaemonSet in deploy/")
		return nil
	}
	ds := daemonSet()
	nsName := "shutdown-" + fmt.Sprint(time.Now().UnixNano()%1e9)
	if _, err := testEnv.CreateNamespace(ctx, nsName, nil); err != nil {
		t.Fatal(err)
	}
	// Installed with a name prefix, the agent may read its DaemonSet by the
	// prefixed name only (rbac.yaml's resourceNames follow it): that one
	// for the install's identity, deploy/'s own name for the environment's.
	inst := installDeploy(t, ctx, "namePrefix: e2e-shutdown-")
	mine := daemonSet()
	mine.SetName(inst.daemonSet)
	mine.SetNamespace(nsName)
	mine.SetFinalizers([]string{"e2e.ambientd.io/hold"})
	ds.SetNamespace(nsName)
	ds.SetFinalizers([]string{"e2e.ambientd.io/hold"}) // keeps it "being deleted" until removed
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, d := range []*unstructured.Unstructured{mine, ds} {
		if err := serverSideApply(ctx, dyn, mapper, d, false); err != nil {
			t.Fatalf("creating the DaemonSet %s: %v", d.GetName(), err)
		}
	}
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = admin.AppsV1().DaemonSets(nsName).Patch(c, mine.GetName(), types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	})
	decide := func(c kube.Interface, proven bool) (bool, string, error) {
		t.Helper()
		r := shutdownrule.New(c, nsName, mine.GetName(), testEnv.NodeName)
		if err := r.Probe(ctx); (err == nil) != proven {
			t.Fatalf("probe with the agent's identity: %v", err)
		}
		return r.Decide(ctx)
	}
	// waitDecision calls decide until it answers uninstall with a reason
	// containing want (RBAC and authentication caches follow deletions
	// within moments).
	waitDecision := func(what string, r *shutdownrule.Rule, want string) {
		t.Helper()
		var u bool
		var reason string
		var err error
		if werr := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			u, reason, err = r.Decide(ctx)
			return u && strings.Contains(reason, want), nil
		}); werr != nil {
			t.Fatalf("%s: uninstall=%v (%s) err=%v, want uninstall: %s", what, u, reason, err, want)
		}
		t.Logf("%s: uninstall: %s", what, reason)
	}
	// waitKeep calls decide until the identity is refused (the reason
	// contains want) and checks that the answer is keep.
	waitKeep := func(what string, r *shutdownrule.Rule, want string) {
		t.Helper()
		var u bool
		var reason string
		var err error
		if werr := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			u, reason, err = r.Decide(ctx)
			return strings.Contains(reason, want), nil
		}); werr != nil || u || err != nil {
			t.Fatalf("%s: uninstall=%v (%s) err=%v (wait: %v), want keep, refused: %s", what, u, reason, err, werr, want)
		}
		t.Logf("%s: keep: %s", what, reason)
	}
	// watching starts the rule as the running agent does (Probe, then a
	// watch held open until the test ends).
	watching := func(c kube.Interface) *shutdownrule.Rule {
		t.Helper()
		r := shutdownrule.New(c, nsName, mine.GetName(), testEnv.NodeName)
		if err := r.Probe(ctx); err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); r.Watch(wctx, testutil.Logger(t, slog.LevelDebug)) }()
		t.Cleanup(func() { cancel(); <-done })
		return r
	}

	agentCfg, agentPod := inst.podToken(t, ctx, testEnv.NodeName)
	agentClient, err := kube.NewForConfig(agentCfg)
	if err != nil {
		t.Fatal(err)
	}
	if u, reason, err := decide(agentClient, true); u || err != nil {
		t.Fatalf("DaemonSet present: uninstall=%v (%s) err=%v, want leave in place", u, reason, err)
	}
	// The agent pod force-deleted; its DaemonSet stays.
	forced := watching(agentClient)
	if err := admin.CoreV1().Pods(inst.namespace).Delete(ctx, agentPod, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil {
		t.Fatal(err)
	}
	waitKeep("agent pod force-deleted, DaemonSet stays", forced, "credentials are no longer accepted")

	// The replacement agent, then the uninstall in kubectl's order.
	replCfg, _ := inst.podToken(t, ctx, testEnv.NodeName)
	replClient, err := kube.NewForConfig(replCfg)
	if err != nil {
		t.Fatal(err)
	}
	proven := watching(replClient)
	testutil.Until(t, ctx, "the rule watching its DaemonSet", proven.Watching)
	// kubectl's order, back to back: binding, ServiceAccount, DaemonSet.
	if err := admin.RbacV1().ClusterRoleBindings().Delete(ctx, "e2e-shutdown-ambientd", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := admin.CoreV1().ServiceAccounts(inst.namespace).Delete(ctx, inst.serviceAccount, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := admin.AppsV1().DaemonSets(nsName).Delete(ctx, mine.GetName(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitDecision("then the DaemonSet deleted", proven, "being deleted")

	// An identity that could never read the DaemonSet: its refusal at
	// shutdown is no sign of an uninstall.
	if err := testEnv.EnsureServiceAccount(ctx, nsName, "no-rights"); err != nil {
		t.Fatal(err)
	}
	tr, err := admin.CoreV1().ServiceAccounts(nsName).CreateToken(ctx, "no-rights", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	noRights := rest.CopyConfig(testEnv.CP.AgentConfig)
	noRights.BearerToken = tr.Status.Token
	noRightsClient, err := kube.NewForConfig(noRights)
	if err != nil {
		t.Fatal(err)
	}
	if u, reason, err := decide(noRightsClient, false); u || err == nil {
		t.Fatalf("identity that never could read the DaemonSet: uninstall=%v (%s) err=%v, want keep with an error", u, reason, err)
	}

	// The environment's agent identity (deploy/rbac.yaml's binding): the
	// namespace being deleted (no namespace controller runs here: it stays
	// Terminating with the DaemonSet in it), the DaemonSet being deleted,
	// then gone.
	env := shutdownrule.New(agentKube(t), nsName, ds.GetName(), testEnv.NodeName)
	if err := env.Probe(ctx); err != nil {
		t.Fatal(err)
	}
	if err := admin.CoreV1().Namespaces().Delete(ctx, nsName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Let the namespace go (its finalizer would wait for the
		// namespace controller).
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if ns, err := admin.CoreV1().Namespaces().Get(c, nsName, metav1.GetOptions{}); err == nil {
			ns.Spec.Finalizers = nil
			_, _ = admin.CoreV1().Namespaces().Finalize(c, ns, metav1.UpdateOptions{})
		}
	})
	waitDecision("namespace being deleted", env, "namespace "+nsName)
	if err := admin.AppsV1().DaemonSets(nsName).Delete(ctx, ds.GetName(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitDecision("DaemonSet being deleted", env, "being deleted")
	if _, err := admin.AppsV1().DaemonSets(nsName).Patch(ctx, ds.GetName(), types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "DaemonSet gone", time.Minute, func() bool {
		_, err := admin.AppsV1().DaemonSets(nsName).Get(ctx, ds.GetName(), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	waitDecision("DaemonSet gone", env, "is gone")
}
