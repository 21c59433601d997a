//go:build e2e

package e2e

// End-to-end tests of `ambientd webhook` (admission/webhook): the real
// binary, registered on the real kube-apiserver with the configuration and
// the RBAC the chart ships (components/readiness-gate-webhook), acting as
// its service account.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/cases"
	"github.com/ambientd/ambientd/admission/webhook"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// shippedWebhook is the webhook's part of deploy/ with the
// readiness-gate-webhook component: what the apiserver needs (RBAC, the CA
// Secret, the configuration), not the Deployment, Service and
// PodDisruptionBudget (no kubelet runs them here: the test runs the binary).
type shippedWebhook struct {
	objs   []*unstructured.Unstructured
	config *unstructured.Unstructured
	// never are the namespaces the configuration's namespaceSelector keeps
	// out (kubernetes.io/metadata.name NotIn).
	never []string
}

// webhookOverlay renders deploy/ with the readiness-gate-webhook component,
// as an overlay for a cluster before 1.36 would.
func webhookOverlay(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	dir := t.TempDir()
	deploy, err := filepath.Rel(dir, filepath.Join(testEnv.Root, "deploy"))
	if err != nil {
		t.Fatal(err)
	}
	kust := fmt.Sprintf("resources: [%s]\ncomponents: [%s/components/readiness-gate-webhook]\n", deploy, deploy)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kust), 0o644); err != nil {
		t.Fatal(err)
	}
	// Through JSON: kustomize's maps hold Go ints, which unstructured's
	// deep copies refuse.
	var out []*unstructured.Unstructured
	for _, o := range kustomize(t, dir) {
		b, err := json.Marshal(o.Object)
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(b); err != nil {
			t.Fatal(err)
		}
		out = append(out, u)
	}
	return out
}

func renderWebhook(t *testing.T) shippedWebhook {
	t.Helper()
	var w shippedWebhook
	policies := 0
	for _, o := range webhookOverlay(t) {
		switch k := o.GetKind(); {
		case k == "MutatingAdmissionPolicy" || k == "MutatingAdmissionPolicyBinding":
			policies++
		case k == "MutatingWebhookConfiguration":
			w.config = o
			hooks, _, _ := unstructured.NestedSlice(o.Object, "webhooks")
			exprs, _, _ := unstructured.NestedSlice(hooks[0].(map[string]any), "namespaceSelector", "matchExpressions")
			for _, e := range exprs {
				e := e.(map[string]any)
				if e["key"] == "kubernetes.io/metadata.name" && e["operator"] == "NotIn" {
					for _, v := range e["values"].([]any) {
						w.never = append(w.never, v.(string))
					}
				}
			}
		case strings.HasPrefix(o.GetName(), "ambientd-webhook") && k != "Deployment" && k != "Service" && k != "PodDisruptionBudget":
			w.objs = append(w.objs, o)
		}
	}
	if policies != 0 || w.config == nil || len(w.objs) != 6 || len(w.never) == 0 {
		t.Fatalf("the webhook component renders %d policy objects (want none), configuration %v, %d other objects (want 6), never %q", policies, w.config != nil, len(w.objs), w.never)
	}
	return w
}

// install applies the webhook's RBAC, Secret and configuration (its
// clientConfig pointed at url instead of the Service) and removes them
// (the configuration first) at the end of the test.
func (w shippedWebhook) install(t *testing.T, ctx context.Context, url string) {
	t.Helper()
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	cfg := w.config.DeepCopy()
	hooks, _, _ := unstructured.NestedSlice(cfg.Object, "webhooks")
	h := hooks[0].(map[string]any)
	h["clientConfig"] = map[string]any{"url": url}
	if err := unstructured.SetNestedSlice(cfg.Object, hooks, "webhooks"); err != nil {
		t.Fatal(err)
	}
	all := append(slices.Clone(w.objs), cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for i := len(all) - 1; i >= 0; i-- {
			if err := deleteObject(ctx, dyn, mapper, all[i]); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete %s %s: %v", all[i].GetKind(), all[i].GetName(), err)
			}
		}
	})
	for _, o := range all {
		if err := serverSideApply(ctx, dyn, mapper, o, false); err != nil {
			t.Fatalf("apply %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
}

// startWebhook starts a replica as the chart's service account (its CA
// Secret and the agent's ConfigMap in the agent's namespace); it is ready
// once the shipped RBAC is in place (waitReady).
func startWebhook(t *testing.T, ctx context.Context, name string, args ...string) *e2eenv.Webhook {
	t.Helper()
	wh, err := testEnv.StartWebhook(ctx, e2eenv.WebhookConfig{Name: name, ServiceAccount: e2eenv.AgentNamespace + "/ambientd-webhook", Args: args})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		wh.LogOnFailure(t)
		_ = wh.Stop(10 * time.Second)
	})
	return wh
}

func waitReady(t *testing.T, ctx context.Context, whs ...*e2eenv.Webhook) {
	t.Helper()
	for _, wh := range whs {
		if err := wh.WaitReady(ctx); err != nil {
			t.Fatalf("%v\n%s", err, wh.LogTail(30))
		}
	}
}

// judgeTable creates (dry run) every case of e, group by group (changing
// the agent's ConfigMap between groups), until the admitted pods' gates
// are what want says, and returns them by case name.
func judgeTable(t *testing.T, ctx context.Context, pa podAdmission, e cases.Enrollment, want func(cases.EnrollmentCase) []string) map[string][]string {
	t.Helper()
	got := map[string][]string{}
	for _, g := range cases.Groups(e.Cases) {
		pa.setAgentConfig(t, ctx, g[0].Settings) // nil: the shipped data
		var mismatch []string
		judge := func(ctx context.Context) (bool, error) {
			mismatch = mismatch[:0]
			for _, c := range g {
				p, err := dryRunPod(ctx, &c.Pod)
				if err != nil {
					return false, fmt.Errorf("%s: create: %w", c.Name, err)
				}
				got[c.Name] = gateTypes(p)
				if w := want(c); !slices.Equal(got[c.Name], w) {
					mismatch = append(mismatch, fmt.Sprintf("%s: gates %q, want %q", c.Name, got[c.Name], w))
				}
			}
			return len(mismatch) == 0, nil
		}
		// The apiserver and the webhook pick up a new ConfigMap
		// asynchronously.
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, judge)
		if err != nil && !wait.Interrupted(err) {
			t.Fatal(err)
		}
		for _, m := range mismatch {
			t.Errorf("settings %v: %s", g[0].Settings, m)
		}
	}
	return got
}

// TestDeployWebhookComponentDryRunApply: deploy/ with the
// readiness-gate-webhook component is accepted object for object by the
// real kube-apiserver (server-side dry run): the Deployment, its
// PodDisruptionBudget, Service, RBAC, Secret and the configuration.
func TestDeployWebhookComponentDryRunApply(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	kinds := map[string]bool{}
	for _, o := range webhookOverlay(t) {
		kinds[o.GetKind()] = true
		if err := serverSideApply(ctx, dyn, mapper, o, true); err != nil {
			t.Errorf("server-side dry-run apply of %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	for _, k := range []string{"Deployment", "PodDisruptionBudget", "Service", "MutatingWebhookConfiguration", "Secret", "ValidatingAdmissionPolicy"} {
		if !kinds[k] {
			t.Errorf("no %s", k)
		}
	}
	if kinds["MutatingAdmissionPolicy"] {
		t.Error("the component keeps the MutatingAdmissionPolicy")
	}
}

// TestWebhookAgreesWithThePolicy: the enrollment table
// (admission/cases/enrollment.yaml: every enrollment case, sidecar pods,
// opt-outs, excluded namespaces, hostNetwork, static mirror pods, the
// settings) is admitted once by the shipped MutatingAdmissionPolicy and
// once, with the policy removed, by `ambientd webhook` registered with the
// shipped configuration: every pod comes out with the same gates — except
// in the namespaces the webhook's configuration never sends (kube-system,
// the mesh's own), where the webhook leaves pods as they are. The webhook
// acts as the chart's service account, so its rights are the shipped ones.
func TestWebhookAgreesWithThePolicy(t *testing.T) {
	ctx := testutil.Context(t, 5*time.Minute)
	e, err := cases.LoadEnrollment()
	if err != nil {
		t.Fatal(err)
	}
	ensureTableNamespaces(t, ctx, e)
	sw := renderWebhook(t)
	pa := installPodAdmission(t, ctx)
	table := func(c cases.EnrollmentCase) []string { return append([]string{}, c.Gates...) }
	viaPolicy := judgeTable(t, ctx, pa, e, table)

	// The policy out (and seen out), the webhook in.
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, o := range pa.objs {
		if o.GetKind() == "MutatingAdmissionPolicy" || o.GetKind() == "MutatingAdmissionPolicyBinding" {
			if err := deleteObject(ctx, dyn, mapper, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	probeNS := uniqueNS("wh-probe")
	createNamespace(t, ctx, probeNS, true)
	gating := func() bool {
		p, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: probeNS}})
		return err == nil && len(p.Spec.ReadinessGates) == 1
	}
	testutil.Until(t, ctx, "the policy no longer gating", func() bool { return !gating() })
	wh := startWebhook(t, ctx, "webhook")
	start := time.Now()
	sw.install(t, ctx, wh.URL)
	waitReady(t, ctx, wh)
	testutil.Until(t, ctx, "the webhook gating", gating)
	t.Logf("webhook in force %s after its RBAC and configuration were applied (caBundle written by the webhook)", time.Since(start).Round(time.Millisecond))

	outOfScope := func(c cases.EnrollmentCase) bool { return slices.Contains(sw.never, c.Pod.Namespace) }
	viaWebhook := judgeTable(t, ctx, pa, e, func(c cases.EnrollmentCase) []string {
		if outOfScope(c) {
			return gateTypes(&c.Pod) // never sent: as submitted
		}
		return table(c)
	})
	agree, differ := 0, 0
	for _, c := range e.Cases {
		switch {
		case outOfScope(c):
			differ += btoi(!slices.Equal(viaPolicy[c.Name], viaWebhook[c.Name]))
		case !slices.Equal(viaPolicy[c.Name], viaWebhook[c.Name]):
			t.Errorf("%s: policy %q, webhook %q", c.Name, viaPolicy[c.Name], viaWebhook[c.Name])
		default:
			agree++
		}
	}
	t.Logf("%d cases: webhook and policy agree on %d; %d in namespaces the webhook never sees (%q), %d of them gated by the policy only", len(e.Cases), agree, len(e.Cases)-agree, sw.never, differ)
	if m, err := wh.Metrics(ctx); err == nil {
		t.Logf("webhook reviews: %s", metricLines(m, "ambientd_webhook_reviews_total"))
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// metricLines returns the sample lines of one metric family.
func metricLines(text, name string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, name) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "; ")
}

// TestWebhookRotationLosesNoPod: two replicas keep one CA (the Secret);
// the one the apiserver calls serves leaves of 10 s, replaced every ~7 s,
// while four clients create pods in an ambient namespace for 25 s: every
// pod comes back gated (a failed call would admit it without the gate:
// failurePolicy Ignore), across at least three rotations; and the other
// replica's leaf verifies against the same caBundle.
func TestWebhookRotationLosesNoPod(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	nsName := uniqueNS("wh-rot")
	createNamespace(t, ctx, nsName, true)
	pa := installPodAdmission(t, ctx) // the agent's ConfigMap
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, o := range pa.objs {
		if o.GetKind() == "MutatingAdmissionPolicyBinding" {
			if err := deleteObject(ctx, dyn, mapper, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	gated := func() bool {
		p, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: nsName}})
		return err == nil && len(p.Spec.ReadinessGates) == 1
	}
	testutil.Until(t, ctx, "the policy no longer gating", func() bool { return !gated() })
	sw := renderWebhook(t)
	a := startWebhook(t, ctx, "webhook-a", "--cert-validity=10s")
	b := startWebhook(t, ctx, "webhook-b", "--cert-validity=10s")
	sw.install(t, ctx, a.URL)
	waitReady(t, ctx, a, b)
	testutil.Until(t, ctx, "the webhook gating", gated)

	rotationsOf := func(w *e2eenv.Webhook) float64 {
		m, err := w.Metrics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var v float64
		for _, l := range strings.Split(m, "\n") {
			if strings.HasPrefix(l, `ambientd_webhook_certificate_rotations_total{kind="leaf"}`) {
				fmt.Sscanf(strings.Fields(l)[1], "%g", &v)
			}
		}
		return v
	}
	before := rotationsOf(a)
	var created, ungated atomic.Int64
	var mu sync.Mutex
	var failures []string
	deadline := time.Now().Add(25 * time.Second)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for n := 0; time.Now().Before(deadline); n++ {
				p, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: nsName, Name: fmt.Sprintf("p-%d-%d", i, n)}})
				mu.Lock()
				switch {
				case err != nil:
					failures = append(failures, err.Error())
				case len(p.Spec.ReadinessGates) != 1:
					ungated.Add(1)
				}
				mu.Unlock()
				created.Add(1)
			}
		})
	}
	wg.Wait()
	rotations := rotationsOf(a) - before
	t.Logf("%d pods created across %v leaf rotations: %d without the gate, %d refused", created.Load(), rotations, ungated.Load(), len(failures))
	if ungated.Load() > 0 || len(failures) > 0 {
		t.Errorf("%d pods admitted without the gate, %d refused (first: %v)", ungated.Load(), len(failures), first(failures))
	}
	if rotations < 3 {
		t.Errorf("%v leaf rotations in 25 s with --cert-validity=10s: want at least 3", rotations)
	}
	if created.Load() < 100 {
		t.Errorf("only %d pods created", created.Load())
	}

	// One CA for both replicas: b's leaf verifies against the caBundle a
	// and b keep.
	cfg, err := testEnv.CP.Admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, admission.MutatingPolicyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(cfg.Webhooks[0].ClientConfig.CABundle) {
		t.Fatal("no caBundle")
	}
	conn, err := tls.Dial("tcp", strings.TrimSuffix(strings.TrimPrefix(b.URL, "https://"), webhook.Path), &tls.Config{RootCAs: pool, ServerName: "localhost"})
	if err != nil {
		t.Fatalf("replica b's certificate against the caBundle: %v", err)
	}
	conn.Close()
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

// TestWebhookNeverTouchesOtherWebhooks: the attack on the caBundle — a
// second webhook in the same configuration, and a configuration of another
// name with a webhook of the same name — is never written: the replica
// writes its own entry's caBundle only, and its service account may not
// write another configuration at all.
func TestWebhookNeverTouchesOtherWebhooks(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	installPodAdmission(t, ctx)
	sw := renderWebhook(t)
	wh := startWebhook(t, ctx, "webhook")
	other := []byte("-----BEGIN CERTIFICATE-----\nMIIBother\n-----END CERTIFICATE-----\n")
	cfg := sw.config.DeepCopy()
	hooks, _, _ := unstructured.NestedSlice(cfg.Object, "webhooks")
	second := maps.Clone(hooks[0].(map[string]any))
	second["name"] = "someone-else.example.com"
	second["clientConfig"] = map[string]any{"url": "https://localhost:1/x", "caBundle": base64.StdEncoding.EncodeToString(other)}
	// Never called: it selects no namespace.
	second["namespaceSelector"] = map[string]any{"matchLabels": map[string]any{"no-such": "label"}}
	if err := unstructured.SetNestedSlice(cfg.Object, append(hooks, second), "webhooks"); err != nil {
		t.Fatal(err)
	}
	sw.config = cfg
	sw.install(t, ctx, wh.URL)
	waitReady(t, ctx, wh)
	testutil.Until(t, ctx, "caBundle written", func() bool {
		c, err := testEnv.CP.Admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, admission.MutatingPolicyName, metav1.GetOptions{})
		return err == nil && len(c.Webhooks[0].ClientConfig.CABundle) > 0
	})
	c, err := testEnv.CP.Admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, admission.MutatingPolicyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if string(c.Webhooks[1].ClientConfig.CABundle) != string(other) {
		t.Errorf("the other webhook's caBundle was rewritten: %q", c.Webhooks[1].ClientConfig.CABundle)
	}
	// The service account's own rights: no other configuration.
	foreign := c.DeepCopy()
	foreign.ObjectMeta = metav1.ObjectMeta{Name: "someone-elses-config"}
	foreign.Webhooks = foreign.Webhooks[1:]
	if _, err := testEnv.CP.Admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, foreign, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = testEnv.CP.Admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Delete(context.Background(), foreign.Name, metav1.DeleteOptions{})
	})
	as := impersonated(t, e2eenv.AgentNamespace, "ambientd-webhook")
	got, err := as.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, foreign.Name, metav1.GetOptions{})
	if !apierrors.IsForbidden(err) {
		t.Errorf("the webhook's service account reads another configuration: %v, %v", got != nil, err)
	}
	if _, err := as.CoreV1().Secrets(e2eenv.AgentNamespace).Get(ctx, "ambientd-webhook-ca", metav1.GetOptions{}); err != nil {
		t.Errorf("its own Secret: %v", err)
	}
	if _, err := as.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("listing another namespace's Secrets: %v, want Forbidden", err)
	}
}

// impersonated is a client acting as the service account ns/name (the
// admin impersonates it: the RBAC bound to it decides).
func impersonated(t *testing.T, ns, name string) kubernetes.Interface {
	t.Helper()
	cfg := rest.CopyConfig(testEnv.CP.AdminConfig)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + ns + ":" + name,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestWebhookDownPodsAreReported: with the webhook registered, a pod of an
// ambient namespace gets the gate and is held NotReady until enrolled; once
// no replica answers, pod creation goes on (failurePolicy Ignore: never a
// refused pod) without the gate — and the agent reports the pod it enrolls
// without one: a Warning Event ReadinessGateMissing on the pod,
// ambientd_pods_missing_readiness_gate, and GATE missing in `ambientd
// status`. The gated pod is not reported.
func TestWebhookDownPodsAreReported(t *testing.T) {
	s := newScenario(t, "wh-down")
	ctx := s.ctx
	pa := installPodAdmission(t, ctx) // the agent's ConfigMap
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, o := range pa.objs {
		if o.GetKind() == "MutatingAdmissionPolicyBinding" {
			if err := deleteObject(ctx, dyn, mapper, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	probe := func() int {
		p, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: s.ns}})
		if err != nil {
			return -1
		}
		return len(p.Spec.ReadinessGates)
	}
	testutil.Until(t, ctx, "the policy no longer gating", func() bool { return probe() == 0 })
	sw := renderWebhook(t)
	wh := startWebhook(t, ctx, "webhook")
	sw.install(t, ctx, wh.URL)
	waitReady(t, ctx, wh)
	testutil.Until(t, ctx, "the webhook gating", func() bool { return probe() == 1 })

	gated := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "gated"})
	if err := wh.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	down := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "while-down"})
	t.Logf("pod created %s after the webhook stopped", time.Since(start).Round(time.Millisecond))
	for _, p := range []*e2eenv.Pod{gated, down} {
		waitPodAnnotationObj(t, ctx, p, "enabled")
	}
	o, err := testEnv.CP.Admin.CoreV1().Pods(s.ns).Get(ctx, down.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.Spec.ReadinessGates) != 0 {
		t.Fatalf("while-down got gates %q with the webhook stopped", gateTypes(o))
	}
	if o, _ := testEnv.CP.Admin.CoreV1().Pods(s.ns).Get(ctx, gated.Name, metav1.GetOptions{}); len(o.Spec.ReadinessGates) != 1 {
		t.Fatalf("gated has gates %q", gateTypes(o))
	}
	testutil.Until(t, ctx, "Event ReadinessGateMissing on while-down", func() bool {
		evs, err := testEnv.CP.Admin.CoreV1().Events(s.ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, e := range evs.Items {
			if e.Reason == agent.EventReadinessGateMissing && e.InvolvedObject.Name == down.Name && e.Type == corev1.EventTypeWarning {
				return true
			}
		}
		return false
	})
	if n, err := s.agent.Metric(ctx, "ambientd_pods_missing_readiness_gate", ""); err != nil || n != 1 {
		t.Errorf("ambientd_pods_missing_readiness_gate = %v (%v), want 1", n, err)
	}
	st := statusJSON(t, ctx)
	for _, p := range []*e2eenv.Pod{gated, down} {
		row, ok := findPod(st, p.UID)
		if !ok || row.MissingGate != (p == down) {
			t.Errorf("ambientd status: %s: found %v, missing gate %v", p.Name, ok, row.MissingGate)
		}
	}
	out, _, _ := ambientdStatus(t, ctx)
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, down.Name) && !strings.Contains(l, "missing") {
			t.Errorf("ambientd status row without GATE missing: %q", l)
		}
	}
}
