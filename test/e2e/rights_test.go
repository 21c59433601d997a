//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// renderOverlay renders deploy/ through a kustomize overlay made of
// `resources: [deploy/]` plus the kustomization lines in extra (e.g.
// "namePrefix: acme-"; $DEPLOY in them is the relative path to deploy/), as
// a user's overlay would.
func renderOverlay(t *testing.T, extra string) []*unstructured.Unstructured {
	t.Helper()
	dir := t.TempDir()
	base, err := filepath.Rel(dir, filepath.Join(testEnv.Root, "deploy"))
	if err != nil {
		t.Fatal(err)
	}
	extra = strings.ReplaceAll(extra, "$DEPLOY", base)
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - " + base + "\n" + extra + "\n"
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	return kustomize(t, dir)
}

// agentInstall is deploy/, rendered through an overlay, applied to the real
// apiserver without its DaemonSet (no kubelet runs here) and without any
// Namespace: the agent's ServiceAccount, ClusterRole and binding, its
// ConfigMap, and the admission policy with its binding.
type agentInstall struct {
	namespace, serviceAccount string
	daemonSet                 string // the agent's DaemonSet (not applied: read by name only)
	policy                    string // the ValidatingAdmissionPolicy's name
}

// installDeploy applies deploy/ rendered with the overlay lines extra and
// waits until the admission policy is in force. Cleanup deletes it all and
// waits until the policy no longer applies (the environment's own agent,
// bound to deploy/rbac.yaml's role too, runs with a static token without a
// node claim, which the policy refuses).
func installDeploy(t *testing.T, ctx context.Context, extra string) *agentInstall {
	t.Helper()
	a := &agentInstall{}
	var objs []*unstructured.Unstructured
	for _, o := range renderOverlay(t, extra) {
		switch o.GetKind() {
		case "Namespace":
			continue // never ours to create or delete here
		case "DaemonSet":
			a.namespace, a.daemonSet = o.GetNamespace(), o.GetName()
			a.serviceAccount, _, _ = unstructured.NestedString(o.Object, "spec", "template", "spec", "serviceAccountName")
			continue
		case "ValidatingAdmissionPolicy":
			a.policy = o.GetName()
		}
		objs = append(objs, o)
	}
	if a.serviceAccount == "" || a.policy == "" {
		t.Fatalf("deploy/ (%s): no DaemonSet service account (%q) or no admission policy (%q)", extra, a.serviceAccount, a.policy)
	}
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		// Policy and binding first: the rest is what they read.
		slices.SortStableFunc(objs, func(x, y *unstructured.Unstructured) int {
			return boolInt(!strings.HasPrefix(x.GetKind(), "ValidatingAdmission")) - boolInt(!strings.HasPrefix(y.GetKind(), "ValidatingAdmission"))
		})
		for _, o := range objs {
			if err := deleteObject(ctx, dyn, mapper, o); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete %s %s: %v", o.GetKind(), o.GetName(), err)
			}
		}
		probe := func(v string) []byte {
			return []byte(`{"metadata":{"annotations":{"e2e.ambientd.io/probe":"` + v + `"}}}`)
		}
		n := 0
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			n++
			_, err := testEnv.CP.Agent.CoreV1().Nodes().Patch(ctx, testEnv.NodeName, types.MergePatchType, probe(fmt.Sprint(n)), metav1.PatchOptions{})
			return err == nil, nil
		})
		if err != nil {
			t.Errorf("admission policy %s still enforced after deletion: %v", a.policy, err)
		}
		_, _ = testEnv.CP.Admin.CoreV1().Nodes().Patch(ctx, testEnv.NodeName, types.MergePatchType, []byte(`{"metadata":{"annotations":{"e2e.ambientd.io/probe":null}}}`), metav1.PatchOptions{})
	})
	for _, o := range objs {
		if err := serverSideApply(ctx, dyn, mapper, o, false); err != nil {
			t.Fatalf("applying %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	return a
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// token returns a client config for the install's ServiceAccount with a
// token made the way the kubelet makes the one it projects into the agent's
// pod: a TokenRequest bound to a pod of that ServiceAccount scheduled on
// node, into which the apiserver stamps the node's name (admission sees it as
// userInfo.extra["authentication.kubernetes.io/node-name"]). node "" makes a
// token bound to nothing, without the claim (as `kubectl create token`).
// The claims are checked with a SelfSubjectReview.
func (a *agentInstall) token(t *testing.T, ctx context.Context, node string) *rest.Config {
	t.Helper()
	cfg, _ := a.podToken(t, ctx, node)
	return cfg
}

// podToken is token, and the name of the agent pod the token is bound to
// (deleting the pod invalidates the token, as for a real agent pod).
func (a *agentInstall) podToken(t *testing.T, ctx context.Context, node string) (*rest.Config, string) {
	t.Helper()
	return a.boundTokenPod(t, ctx, node, "Pod")
}

// boundToken is token with the TokenRequest bound to an object of kind
// "Pod" (a pod of the ServiceAccount on node) or "Node" (node itself, as
// `kubectl create token --bound-object-kind Node`): both carry the claim.
func (a *agentInstall) boundToken(t *testing.T, ctx context.Context, node, kind string) *rest.Config {
	t.Helper()
	cfg, _ := a.boundTokenPod(t, ctx, node, kind)
	return cfg
}

func (a *agentInstall) boundTokenPod(t *testing.T, ctx context.Context, node, kind string) (*rest.Config, string) {
	t.Helper()
	podName := ""
	admin := testEnv.CP.Admin
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr(int64(3600))}}
	if node != "" && kind == "Node" {
		n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Node", APIVersion: "v1", Name: n.Name, UID: n.UID}
	} else if node != "" {
		pod, err := admin.CoreV1().Pods(a.namespace).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{GenerateName: a.serviceAccount + "-"},
			Spec: corev1.PodSpec{
				NodeName: node, ServiceAccountName: a.serviceAccount, AutomountServiceAccountToken: ptr(false),
				Containers: []corev1.Container{{Name: "ambientd", Image: "ambientd"}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = admin.CoreV1().Pods(a.namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
		})
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
		podName = pod.Name
	}
	tr, err := admin.CoreV1().ServiceAccounts(a.namespace).CreateToken(ctx, a.serviceAccount, req, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("TokenRequest for %s/%s: %v", a.namespace, a.serviceAccount, err)
	}
	cfg := rest.CopyConfig(testEnv.CP.AgentConfig)
	cfg.BearerToken = tr.Status.Token
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ssr, err := c.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("SelfSubjectReview with the agent's token: %v", err)
	}
	u := ssr.Status.UserInfo
	want := "system:serviceaccount:" + a.namespace + ":" + a.serviceAccount
	if got := u.Extra["authentication.kubernetes.io/node-name"]; u.Username != want || (node == "" && len(got) != 0) || (node != "" && (len(got) != 1 || got[0] != node)) {
		t.Fatalf("token authenticates as %s with node-name %v, want %s with %q", u.Username, got, want, node)
	}
	return cfg, podName
}

// TestAgentRightsOwnNodeOnly checks deploy/'s RBAC and admission policy as
// the agent's own token (a pod-bound service-account token carrying the
// node-name claim, as kubelet projects it), with deploy/ installed through a
// kustomize overlay with a namePrefix (the policy must follow the binding's
// names). The agent's own writes — the real status patcher, node readiness
// controller and event recorder — land on its node; everything else is
// refused: another node's pods and node, fields it does not own on its own
// node's pod and node, pod spec and deletion, Events from another node, and
// any write with a token without the node claim. RuntimeClasses it reads
// (list, watch, get) and cannot write.
func TestAgentRightsOwnNodeOnly(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	admin := testEnv.CP.Admin
	inst := installDeploy(t, ctx, "namePrefix: e2e-rights-")

	foreign := corev1.Taint{Key: "example.com/dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}
	mine := createTestNode(t, ctx, "rights-mine", startupTaint, foreign)
	other := createTestNode(t, ctx, "rights-other", startupTaint, foreign)
	ns := fmt.Sprintf("rights-%d", time.Now().UnixNano()%1e9)
	if _, err := testEnv.CreateNamespace(ctx, ns, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{}) })
	newPod := func(name, node string) *corev1.Pod {
		p, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": name}, Annotations: map[string]string{"team": "web"}},
			Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "app:v1"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	own, theirs, probe := newPod("own", mine), newPod("theirs", other), newPod("probe", other)

	agentCfg := inst.token(t, ctx, mine)
	agentClient, err := kubernetes.NewForConfig(agentCfg)
	if err != nil {
		t.Fatal(err)
	}
	// The agent's own client (what ambientd links), for the writes the
	// agent makes through it: pod status, Events.
	agentLean, err := kube.NewForConfig(agentCfg)
	if err != nil {
		t.Fatal(err)
	}
	unboundClient, err := kubernetes.NewForConfig(inst.token(t, ctx, ""))
	if err != nil {
		t.Fatal(err)
	}

	patchPod := func(c kubernetes.Interface, name, body string, sub ...string) error {
		_, err := c.CoreV1().Pods(ns).Patch(ctx, name, types.StrategicMergePatchType, []byte(body), metav1.PatchOptions{}, sub...)
		return err
	}
	patchNode := func(c kubernetes.Interface, name, body string, sub ...string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, []byte(body), metav1.PatchOptions{}, sub...)
		return err
	}
	annotate := func(v string) string {
		return `{"metadata":{"annotations":{"` + podmeta.AnnotationRedirection + `":"` + v + `"}}}`
	}
	condition := func(typ, status string) string {
		return `{"status":{"conditions":[{"type":"` + typ + `","status":"` + status + `","reason":"E2E"}]}}`
	}

	// The policy loads asynchronously: wait until it refuses a write to
	// another node's pod (a pod of its own: the writes before may land).
	// On manifests whose policy does not cover pods or does not match the
	// install's names, this never happens.
	var last error
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		last = patchPod(agentClient, probe.Name, annotate("pending"), "status")
		return isDenied(last), nil
	}); err != nil {
		t.Errorf("admission policy %s never refused the agent of %s annotating a pod of %s; last answer: %v", inst.policy, mine, other, last)
	}

	t.Run("own writes land", func(t *testing.T) {
		// The agent's status patcher: annotation and condition in one
		// pods/status patch, then the annotation removed.
		results := make(chan podstatus.Result, 16)
		p := podstatus.New(agentLean, testutil.Logger(t, 0), podstatus.Options{
			ConditionType: podmeta.ConditionEnrolled, MaxDelay: 200 * time.Millisecond,
			OnResult: func(r podstatus.Result, _ time.Duration) { results <- r },
		})
		pctx, stop := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Go(func() { p.Run(pctx, 1) })
		defer func() { stop(); wg.Wait() }()
		for _, st := range []podstatus.Status{
			{Redirection: podmeta.RedirectionEnabled, Condition: podstatus.Condition{Status: corev1.ConditionTrue, Reason: "Enrolled", Message: "rights check"}},
			{Redirection: "", Condition: podstatus.Condition{Status: corev1.ConditionFalse, Reason: "NotInMesh", Message: "rights check"}},
		} {
			p.Set(ns, own.Name, string(own.UID), st)
			if r := <-results; r != podstatus.ResultOK {
				t.Fatalf("the agent's pods/status patch %+v of its own node's pod: %s, want ok", st, r)
			}
			got, err := admin.CoreV1().Pods(ns).Get(ctx, own.Name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			c := podConditionOf(got, podmeta.ConditionEnrolled)
			if got.Annotations[podmeta.AnnotationRedirection] != st.Redirection || c == nil || c.Status != st.Condition.Status {
				t.Fatalf("after the agent's patch %+v: annotations %v, condition %+v", st, got.Annotations, c)
			}
		}

		// The node readiness controller: condition written, startup taint
		// removed, the foreign taint kept.
		sw := &switches{}
		sw.setZtunnel(true)
		startNodeReady(t, ctx, nodeready.Config{NodeName: mine, Untaint: true, ResyncPeriod: 200 * time.Millisecond}, sw, agentCfg)
		n := waitNode(t, ctx, mine, "untainted, condition True, by the agent's token", func(n *corev1.Node) bool {
			return !hasTaintKey(n) && conditionIs(corev1.ConditionTrue, nodeready.ReasonReady)(n)
		})
		if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == foreign.Key }) {
			t.Errorf("the agent removed the foreign taint: %v", n.Spec.Taints)
		}
		// Its own taint key back (--taint-when-unready) is its own too.
		body, err := json.Marshal(map[string]any{"spec": map[string]any{"taints": append(n.Spec.Taints,
			corev1.Taint{Key: nodeready.DefaultTaintKey, Effect: corev1.TaintEffectNoSchedule})}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := agentClient.CoreV1().Nodes().Patch(ctx, mine, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
			t.Errorf("agent re-adding its own taint: %v", err)
		}

		// Events, recorded as the agent records them (source host = its
		// node): about its pod, repeated (the recorder then patches the
		// Event), and about its node.
		b := record.NewBroadcaster()
		b.StartRecordingToSink(kube.EventSink{Client: agentLean.CoreV1()})
		defer b.Shutdown()
		rec := b.NewRecorder(kube.NewScheme(), corev1.EventSource{Component: "ambientd", Host: mine})
		podRef := &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: ns, Name: own.Name, UID: own.UID}
		rec.Event(podRef, corev1.EventTypeWarning, "RightsCheck", "first")
		waitEvent(t, ctx, ns, "RightsCheck", func(e corev1.Event) bool { return e.Count == 1 })
		rec.Event(podRef, corev1.EventTypeWarning, "RightsCheck", "first")
		waitEvent(t, ctx, ns, "RightsCheck", func(e corev1.Event) bool { return e.Count == 2 })
		rec.Event(&corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: mine, UID: n.UID}, corev1.EventTypeNormal, "RightsCheckNode", "node")
		waitEvent(t, ctx, metav1.NamespaceDefault, "RightsCheckNode", func(e corev1.Event) bool { return e.InvolvedObject.Name == mine })
	})

	t.Run("reads RuntimeClasses", func(t *testing.T) {
		// The agent's own client lists, watches and gets them (the
		// handler decides whether a pod's traffic can be captured).
		rc, err := admin.NodeV1().RuntimeClasses().Create(ctx, &nodev1.RuntimeClass{
			ObjectMeta: metav1.ObjectMeta{Name: "e2e-rights-" + ns}, Handler: "runsc"}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = admin.NodeV1().RuntimeClasses().Delete(context.Background(), rc.Name, metav1.DeleteOptions{})
		})
		rcs := agentLean.NodeV1().RuntimeClasses()
		if got, err := rcs.Get(ctx, rc.Name, metav1.GetOptions{}); err != nil || got.Handler != "runsc" {
			t.Errorf("agent reading RuntimeClass %s: %v, %v", rc.Name, got, err)
		}
		if l, err := rcs.List(ctx, metav1.ListOptions{}); err != nil || !slices.ContainsFunc(l.Items, func(x nodev1.RuntimeClass) bool { return x.Name == rc.Name }) {
			t.Errorf("agent listing RuntimeClasses: %v", err)
		}
		w, err := rcs.Watch(ctx, metav1.ListOptions{})
		if err != nil {
			t.Errorf("agent watching RuntimeClasses: %v", err)
		} else {
			w.Stop()
		}
		// Read only.
		for what, err := range map[string]error{
			"create a RuntimeClass": func() error {
				_, err := agentClient.NodeV1().RuntimeClasses().Create(ctx, &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "e2e-rights-evil"}, Handler: "runc"}, metav1.CreateOptions{})
				return err
			}(),
			"delete a RuntimeClass": agentClient.NodeV1().RuntimeClasses().Delete(ctx, rc.Name, metav1.DeleteOptions{}),
		} {
			if !apierrors.IsForbidden(err) {
				t.Errorf("agent may %s (answer: %v); want forbidden by RBAC", what, err)
			}
		}
	})

	t.Run("everything else refused", func(t *testing.T) {
		// Refused by RBAC: the agent has no write on pods themselves.
		forbidden := map[string]error{
			"patch another node's pod's image": patchPod(agentClient, theirs.Name, `{"spec":{"containers":[{"name":"app","image":"evil:latest"}]}}`),
			"patch its own node's pod's image": patchPod(agentClient, own.Name, `{"spec":{"containers":[{"name":"app","image":"evil:latest"}]}}`),
			"annotate a pod through pods":      patchPod(agentClient, own.Name, annotate("enabled")),
			"delete its own node's pod":        agentClient.CoreV1().Pods(ns).Delete(ctx, own.Name, metav1.DeleteOptions{}),
			"evict its own node's pod": agentClient.PolicyV1().Evictions(ns).Evict(ctx, &policyv1.Eviction{
				ObjectMeta: metav1.ObjectMeta{Name: own.Name, Namespace: ns}}),
			"delete its node": agentClient.CoreV1().Nodes().Delete(ctx, mine, metav1.DeleteOptions{}),
		}
		_, forbidden["create a pod"] = agentClient.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "x"},
			Spec: corev1.PodSpec{NodeName: mine, Containers: []corev1.Container{{Name: "c", Image: "x"}}}}, metav1.CreateOptions{})
		_, forbidden["read a secret"] = agentClient.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
		// Its own DaemonSet only (rbac.yaml's resourceNames).
		_, forbidden["read another DaemonSet"] = agentClient.AppsV1().DaemonSets(inst.namespace).Get(ctx, "kube-proxy", metav1.GetOptions{})
		_, forbidden["read a DaemonSet of another namespace"] = agentClient.AppsV1().DaemonSets("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
		_, forbidden["list DaemonSets"] = agentClient.AppsV1().DaemonSets(inst.namespace).List(ctx, metav1.ListOptions{})
		for what, err := range forbidden {
			if !apierrors.IsForbidden(err) {
				t.Errorf("agent may %s (answer: %v); want forbidden by RBAC", what, err)
			}
		}
		// Its own DaemonSet it may read (not applied here: NotFound is
		// the answer of a read it is allowed).
		if _, err := agentClient.AppsV1().DaemonSets(inst.namespace).Get(ctx, inst.daemonSet, metav1.GetOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("agent reading its own DaemonSet %s/%s: %v", inst.namespace, inst.daemonSet, err)
		}

		// Refused by the admission policy.
		denied := map[string]error{
			// Another node's pod.
			"annotate another node's pod":             patchPod(agentClient, theirs.Name, annotate("enabled"), "status"),
			"set its condition on another node's pod": patchPod(agentClient, theirs.Name, condition(podmeta.ConditionEnrolled, "True"), "status"),
			// Its own node's pod, beyond its annotation and condition.
			"label its pod through status":           patchPod(agentClient, own.Name, `{"metadata":{"labels":{"app":"evil"}}}`, "status"),
			"change another annotation":              patchPod(agentClient, own.Name, `{"metadata":{"annotations":{"team":"evil"}}}`, "status"),
			"add another annotation":                 patchPod(agentClient, own.Name, `{"metadata":{"annotations":{"sidecar.istio.io/status":"{}"}}}`, "status"),
			"write a value not its own":              patchPod(agentClient, own.Name, annotate("disabled"), "status"),
			"set the pod's Ready condition":          patchPod(agentClient, own.Name, condition("Ready", "True"), "status"),
			"set another condition":                  patchPod(agentClient, own.Name, condition("example.com/gate", "True"), "status"),
			"change the pod's IP":                    patchPod(agentClient, own.Name, `{"status":{"podIP":"10.9.9.9","podIPs":[{"ip":"10.9.9.9"}]}}`, "status"),
			"change the pod's phase":                 patchPod(agentClient, own.Name, `{"status":{"phase":"Succeeded"}}`, "status"),
			"add a finalizer through status":         patchPod(agentClient, own.Name, `{"metadata":{"finalizers":["example.com/hold"]}}`, "status"),
			"annotate without a node claim":          patchPod(unboundClient, own.Name, annotate("enabled"), "status"),
			"set its condition without a node claim": patchPod(unboundClient, own.Name, condition(podmeta.ConditionEnrolled, "True"), "status"),
			// Nodes.
			"remove another node's startup taint":    patchNode(agentClient, other, `{"spec":{"taints":[{"key":"`+foreign.Key+`","value":"db","effect":"NoSchedule"}]}}`),
			"set its condition on another node":      patchNode(agentClient, other, condition(nodeready.DefaultConditionType, "True"), "status"),
			"add another taint key to its node":      patchNode(agentClient, mine, `{"spec":{"taints":[{"key":"`+foreign.Key+`","value":"db","effect":"NoSchedule"},{"key":"example.com/evil","effect":"NoExecute"}]}}`),
			"remove a foreign taint from its node":   patchNode(agentClient, mine, `{"spec":{"taints":[{"key":"`+nodeready.DefaultTaintKey+`","effect":"NoSchedule"}]}}`),
			"label its node":                         patchNode(agentClient, mine, `{"metadata":{"labels":{"x":"y"}}}`),
			"cordon its node":                        patchNode(agentClient, mine, `{"spec":{"unschedulable":true}}`),
			"set its node's Ready condition":         patchNode(agentClient, mine, condition("Ready", "False"), "status"),
			"change its node's addresses":            patchNode(agentClient, mine, `{"status":{"addresses":[{"type":"InternalIP","address":"10.9.9.9"}]}}`, "status"),
			"set its node condition without a claim": patchNode(unboundClient, mine, condition(nodeready.DefaultConditionType, "False"), "status"),
			"remove its taint without a node claim":  patchNode(unboundClient, mine, `{"spec":{"taints":[{"key":"`+foreign.Key+`","value":"db","effect":"NoSchedule"}]}}`),
		}
		// Events: reported from another node, about another node, or a
		// patch of an Event another component wrote.
		event := func(c kubernetes.Interface, host string, about corev1.ObjectReference) error {
			evNs := about.Namespace
			if evNs == "" {
				evNs = metav1.NamespaceDefault // where Events about cluster-scoped objects go
			}
			_, err := c.CoreV1().Events(evNs).Create(ctx, &corev1.Event{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "rights-"}, InvolvedObject: about,
				Reason: "Forged", Message: "forged", Type: corev1.EventTypeWarning,
				Source: corev1.EventSource{Component: "ambientd", Host: host},
			}, metav1.CreateOptions{})
			return err
		}
		theirRef := corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: ns, Name: theirs.Name, UID: theirs.UID}
		denied["create an Event from another node"] = event(agentClient, other, theirRef)
		denied["create an Event about another node"] = event(agentClient, mine, corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: other})
		denied["create an Event without a node claim"] = event(unboundClient, mine, theirRef)
		// A token bound to the node itself (not to a pod) carries the
		// claim too: accepted as that node's agent, confined like it.
		nodeBound, err := kubernetes.NewForConfig(inst.boundToken(t, ctx, mine, "Node"))
		if err != nil {
			t.Fatal(err)
		}
		if err := patchPod(nodeBound, own.Name, annotate("pending"), "status"); err != nil {
			t.Errorf("a node-bound token annotating its node's pod: %v", err)
		}
		denied["annotate another node's pod with a node-bound token"] = patchPod(nodeBound, theirs.Name, annotate("enabled"), "status")
		denied["set another node's condition with a node-bound token"] = patchNode(nodeBound, other, condition(nodeready.DefaultConditionType, "True"), "status")
		kubeletEvent, err := admin.CoreV1().Events(ns).Create(ctx, &corev1.Event{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "kubelet-"}, InvolvedObject: theirRef,
			Reason: "Started", Message: "Started container app", Type: corev1.EventTypeNormal,
			Source: corev1.EventSource{Component: "kubelet", Host: other},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		_, denied["rewrite another component's Event"] = agentClient.CoreV1().Events(ns).Patch(ctx, kubeletEvent.Name, types.StrategicMergePatchType,
			[]byte(`{"message":"forged","source":{"host":"`+mine+`"}}`), metav1.PatchOptions{})
		for what, err := range denied {
			if !isDenied(err) {
				t.Errorf("agent may %s (answer: %v); want denied by the admission policy", what, err)
				continue
			}
			t.Logf("%s: %v", what, err)
		}

		// A spec change through pods/status is dropped by the apiserver
		// itself (whatever the policy says): the spec stays.
		_ = patchPod(agentClient, own.Name, `{"spec":{"activeDeadlineSeconds":1}}`, "status")

		// Nothing of the above landed.
		for _, p := range []*corev1.Pod{own, theirs} {
			got, err := admin.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if got.Spec.Containers[0].Image != "app:v1" || got.Spec.ActiveDeadlineSeconds != nil || got.Labels["app"] != p.Name ||
				got.Annotations["team"] != "web" || len(got.Finalizers) != 0 || got.Status.PodIP != "" || got.Status.Phase != corev1.PodPending ||
				podConditionOf(got, "Ready") != nil || podConditionOf(got, "example.com/gate") != nil {
				t.Errorf("pod %s changed: spec %+v labels %v annotations %v finalizers %v status %+v", p.Name, got.Spec.Containers, got.Labels, got.Annotations, got.Finalizers, got.Status)
			}
		}
		got, err := admin.CoreV1().Pods(ns).Get(ctx, theirs.Name, metav1.GetOptions{})
		if err == nil && (got.Annotations[podmeta.AnnotationRedirection] != "" || podConditionOf(got, podmeta.ConditionEnrolled) != nil) {
			t.Errorf("another node's pod carries the agent's annotation or condition: %v %+v", got.Annotations, got.Status.Conditions)
		}
		o, err := admin.CoreV1().Nodes().Get(ctx, other, metav1.GetOptions{})
		if err != nil || !hasTaintKey(o) || nodeCondition(o) != nil {
			t.Errorf("the other node changed: taints %v, conditions %+v (%v)", o.Spec.Taints, o.Status.Conditions, err)
		}
		m, err := admin.CoreV1().Nodes().Get(ctx, mine, metav1.GetOptions{})
		if err != nil || m.Labels["x"] != "" || m.Spec.Unschedulable || !slices.ContainsFunc(m.Spec.Taints, func(t corev1.Taint) bool { return t.Key == foreign.Key }) ||
			slices.ContainsFunc(m.Spec.Taints, func(t corev1.Taint) bool { return t.Key == "example.com/evil" }) {
			t.Errorf("its own node changed beyond its taint and condition: labels %v, taints %v, unschedulable %v (%v)", m.Labels, m.Spec.Taints, m.Spec.Unschedulable, err)
		}
	})
}

func podConditionOf(p *corev1.Pod, typ string) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if string(p.Status.Conditions[i].Type) == typ {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// waitEvent waits for an Event with reason in namespace ns for which ok holds.
func waitEvent(t *testing.T, ctx context.Context, ns, reason string, ok func(corev1.Event) bool) {
	t.Helper()
	var seen []corev1.Event
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		evs, err := testEnv.CP.Admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + reason})
		if err != nil {
			return false, nil
		}
		seen = evs.Items
		return slices.ContainsFunc(evs.Items, ok), nil
	})
	if err != nil {
		t.Fatalf("Event %s in %s as recorded by the agent's token never landed: %v; seen %+v", reason, ns, err, seen)
	}
}
