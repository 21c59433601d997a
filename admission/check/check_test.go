package check

import (
	"bytes"
	"context"
	"flag"
	"github.com/ambientd/ambientd/podmeta"
	"os"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/admission"

	"github.com/ambientd/ambientd/test/infra/kubetest"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func ns(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

type podOpt func(*corev1.Pod)

func mkpod(nsName, name, node string, opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: nsName, Name: name}, Spec: corev1.PodSpec{NodeName: node}}
	p.Status.Phase = corev1.PodRunning
	for _, o := range opts {
		o(p)
	}
	return p
}

func gate(p *corev1.Pod) {
	p.Spec.ReadinessGates = append(p.Spec.ReadinessGates, corev1.PodReadinessGate{ConditionType: podmeta.ConditionEnrolled})
}

func labels(kv ...string) podOpt {
	return func(p *corev1.Pod) {
		p.Labels = map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			p.Labels[kv[i]] = kv[i+1]
		}
	}
}

func annotated(k, v string) podOpt {
	return func(p *corev1.Pod) {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[k] = v
	}
}

func cond(status corev1.ConditionStatus, reason, msg string) podOpt {
	return func(p *corev1.Pod) {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: podmeta.ConditionEnrolled, Status: status, Reason: reason, Message: msg})
	}
}

func ready(p *corev1.Pod) {
	p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: corev1.PodReady, Status: corev1.ConditionTrue})
}

// cluster is a node served by a Ready agent (node-1), a node without an
// agent (node-2), the shipped policy and ConfigMap, and pods in every state
// check tells apart.
func cluster(withPolicy bool) *fake.Clientset {
	objs := []runtime.Object{
		ns("shop", map[string]string{"istio.io/dataplane-mode": "ambient"}),
		ns("plain", nil),
		ns("istio-system", nil),
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: admission.ConfigMapName}, Data: map[string]string{
			admission.EnvExcludeNamespaces: "kube-system", admission.EnvSystemNamespace: "istio-system",
		}},
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: DefaultNodeConditionType, Status: corev1.ConditionTrue, Reason: "Ready"}}}},
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-2"}},
		mkpod("istio-system", "ambientd-x1", "node-1", labels("app", "ambientd"), ready, func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
		mkpod("shop", "web", "node-1", gate, annotated("ambient.istio.io/redirection", "enabled"), cond("True", "Enrolled", "ztunnel carries the pod's traffic"), ready),
		mkpod("shop", "quarantined", "node-1", gate, annotated("ambient.istio.io/redirection", "pending"), cond("False", "ZtunnelRejected", "policy: denied")),
		mkpod("shop", "unserved", "node-1", gate, annotated("ambient.istio.io/redirection", "enabled"), cond("False", "ZtunnelUnavailable", "no ztunnel has served the node for over 5s")),
		mkpod("shop", "gvisor", "node-1", gate, cond("False", "RuntimeNotCapturable", `the pod's RuntimeClass "gvisor" has runtime handler "runsc", ...`)),
		mkpod("shop", "ungated", "node-1", annotated("ambient.istio.io/redirection", "enabled"), cond("True", "Enrolled", ""), ready),
		mkpod("shop", "batch", "node-1", labels("istio.io/dataplane-mode", "none"), ready),
		mkpod("shop", "switched", "node-1", labels("istio.io/dataplane-mode", "none"), gate, cond("True", "NotInMesh", "the pod is not in the ambient mesh"), ready),
		mkpod("shop", "stranded", "node-2", gate),
		mkpod("shop", "opted", "node-1", labels("ambient.istio.io/readiness-gate", "false"), annotated("ambient.istio.io/redirection", "enabled"), cond("True", "Enrolled", ""), ready),
		mkpod("shop", "bad-annotation", "", gate, annotated("ambient.istio.io/dns-capture", "maybe")),
		mkpod("plain", "payments", "node-1", labels("istio.io/dataplane-mode", "ambient"), gate, annotated("ambient.istio.io/redirection", "enabled"), cond("True", "Enrolled", ""), ready),
		mkpod("plain", "client", "node-2", ready),
		mkpod("plain", "stuck-out", "node-2", gate),
	}
	if withPolicy {
		objs = append(objs,
			&admissionregistrationv1.MutatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: admission.MutatingPolicyName}},
			&admissionregistrationv1.MutatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: admission.MutatingPolicyName}, Spec: admissionregistrationv1.MutatingAdmissionPolicyBindingSpec{PolicyName: admission.MutatingPolicyName}},
			&admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: admission.ValidatingPolicyName}},
			&admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: admission.ValidatingPolicyName}, Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: admission.ValidatingPolicyName}},
		)
	}
	return fake.NewClientset(objs...)
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := "testdata/" + name
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("output differs from %s (go test -update to accept):\n%s", path, got)
	}
}

// TestPods: every state an existing pod can be in, judged and explained;
// the table is a golden file.
func TestPods(t *testing.T) {
	ctx := context.Background()
	c := New(ctx, kubetest.Wrap(cluster(true)), Options{})
	r, err := c.Pods(ctx, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	by := map[string]Pod{}
	for _, p := range r.Pods {
		by[p.Namespace+"/"+p.Name] = p
	}
	want := map[string]struct {
		enrolled, gated, attention bool
		verdict                    string
	}{
		"shop/web":                 {true, true, false, "meshed (enabled)"},
		"shop/quarantined":         {true, true, true, "pending: ZtunnelRejected (policy: denied); NotReady until ztunnel takes it"},
		"shop/unserved":            {true, true, true, "NOT SERVED: no ztunnel serves node node-1 (its traffic is captured and refused); NotReady until one acks its snapshot"},
		"shop/gvisor":              {true, true, true, `NOT MESHED: its runtime handler's traffic cannot be captured, the agent refuses it (the pod's RuntimeClass "gvisor" has runtime handler "runsc", ...)`},
		"shop/ungated":             {true, false, false, "meshed (enabled); no gate: Ready did not wait for the mesh"},
		"shop/batch":               {false, false, false, "not in the mesh"},
		"shop/switched":            {false, true, false, "not in the mesh; the agent released its gate (NotInMesh)"},
		"shop/stranded":            {true, true, true, "NOT MESHED: no agent on node node-2; the gate keeps it NotReady (fail closed)"},
		"shop/opted":               {true, false, false, "meshed (enabled); no gate: Ready did not wait for the mesh"},
		"shop/bad-annotation":      {true, true, true, "NOT MESHED: the agent refuses its annotations: " + by["shop/bad-annotation"].AnnotationError},
		"plain/payments":           {true, true, false, "meshed (enabled)"},
		"plain/client":             {false, false, false, "not in the mesh"},
		"plain/stuck-out":          {false, true, true, "STUCK: gated, not in the mesh, and no agent on node node-2 writes its condition: stays NotReady (run the agent there or remove the gate)"},
		"istio-system/ambientd-x1": {false, false, false, "not in the mesh"},
	}
	if len(by) != len(want) {
		t.Errorf("%d pods reported, want %d", len(by), len(want))
	}
	for name, w := range want {
		p, ok := by[name]
		if !ok {
			t.Errorf("%s: not reported", name)
			continue
		}
		if p.Enrolled != w.enrolled || p.Gated != w.gated || p.Attention != w.attention || p.Verdict != w.verdict {
			t.Errorf("%s: enrolled %v gated %v attention %v %q; want %v %v %v %q", name, p.Enrolled, p.Gated, p.Attention, p.Verdict, w.enrolled, w.gated, w.attention, w.verdict)
		}
	}
	if p := by["shop/web"]; p.Agent == nil || !p.Agent.Serves || !p.Agent.Ready || p.Agent.Pod != "ambientd-x1" || p.Agent.NodeCondition != "True/Ready" ||
		p.Redirection != "enabled" || p.Condition == nil || p.Condition.Reason != "Enrolled" || p.DecidedBy != "namespace shop: istio.io/dataplane-mode=ambient" {
		t.Errorf("shop/web: %+v agent %+v", p, p.Agent)
	}
	if p := by["shop/bad-annotation"]; !strings.Contains(p.AnnotationError, "ambient.istio.io/dns-capture") {
		t.Errorf("shop/bad-annotation: annotation error %q", p.AnnotationError)
	}
	if p := by["shop/opted"]; !strings.HasPrefix(p.Gate, "opted out (pod label") {
		t.Errorf("shop/opted: gate %q", p.Gate)
	}
	if p := by["istio-system/ambientd-x1"]; p.DecidedBy != "spec.hostNetwork: true" {
		t.Errorf("agent pod decided by %q", p.DecidedBy)
	}
	if r.Settings.Source != "ConfigMap istio-system/ambientd-config" || !r.Admission.GatePolicy || !r.Admission.AnnotationPolicy || len(r.Notes) != 0 {
		t.Errorf("settings %+v admission %+v notes %q", r.Settings, r.Admission, r.Notes)
	}
	// The golden table leaves out the refused annotation: its message is
	// the agent's (podmeta) and changes with it.
	r.Pods = slices.DeleteFunc(r.Pods, func(p Pod) bool { return p.Name == "bad-annotation" })
	var b bytes.Buffer
	if err := WriteTable(&b, r); err != nil {
		t.Fatal(err)
	}
	golden(t, "pods.golden", b.Bytes())
}

// TestManifest: a manifest's templates judged with the cluster's namespace
// labels, with and without the admission policy installed.
func TestManifest(t *testing.T) {
	manifest := `apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
spec: {template: {spec: {containers: [{name: c, image: x}]}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: quiet}
spec: {template: {metadata: {labels: {ambient.istio.io/readiness-gate: "false"}}, spec: {containers: [{name: c, image: x}]}}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: plain}
spec: {containers: [{name: c, image: x}]}
---
apiVersion: batch/v1
kind: Job
metadata: {name: j, namespace: nowhere}
spec: {template: {spec: {containers: [{name: c, image: x}]}}}
`
	for _, withPolicy := range []bool{true, false} {
		ctx := context.Background()
		c := New(ctx, kubetest.Wrap(cluster(withPolicy)), Options{})
		r, err := c.Manifest(ctx, strings.NewReader(manifest), "shop")
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		if err := WriteTable(&b, r); err != nil {
			t.Fatal(err)
		}
		name := "manifest-policy.golden"
		if !withPolicy {
			name = "manifest-no-policy.golden"
		}
		golden(t, name, b.Bytes())
		if len(r.Pods) != 4 || r.Pods[0].Gated != withPolicy || r.Pods[0].Attention == withPolicy || r.Pods[1].Gated || r.Pods[2].Enrolled {
			t.Errorf("policy %v: %+v", withPolicy, r.Pods)
		}
	}
}

// TestForbidden: a user who may not read the agent's ConfigMap, the
// admission policies or the agent's pods still gets answers, with notes
// saying what is unknown.
func TestForbidden(t *testing.T) {
	client := cluster(true)
	for _, res := range []string{"configmaps", "mutatingadmissionpolicybindings", "validatingadmissionpolicybindings"} {
		client.PrependReactor("*", res, func(a k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: res}, "", nil)
		})
	}
	client.PrependReactor("list", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetNamespace() == "istio-system" {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", nil)
		}
		return false, nil, nil
	})
	ctx := context.Background()
	r, err := New(ctx, kubetest.Wrap(client), Options{}).Pods(ctx, "shop", []string{"web"})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Pods) != 1 || !r.Pods[0].Enrolled || r.Pods[0].Agent != nil || r.Admission.Known || r.Settings.Source != "the agent's defaults" || len(r.Notes) != 3 {
		t.Errorf("%+v", r)
	}
	for _, n := range r.Notes {
		t.Log("note:", n)
	}
}

// TestManifestWithTheWebhook: on a cluster before Kubernetes 1.36 — no
// MutatingAdmissionPolicy API at all (its list is NotFound), the webhook's
// configuration installed — check knows the gate is added at admission (by
// the webhook), and says nothing is unknown. A configuration without the
// webhook's entry does not count.
func TestManifestWithTheWebhook(t *testing.T) {
	manifest := "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: shop}\nspec: {template: {spec: {containers: [{name: c, image: x}]}}}\n"
	for _, entry := range []string{admission.WebhookName, "someone-else.example.com"} {
		client := cluster(false)
		client.PrependReactor("list", "mutatingadmissionpolicybindings", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewNotFound(schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "mutatingadmissionpolicybindings"}, "")
		})
		if err := client.Tracker().Add(&admissionregistrationv1.MutatingWebhookConfiguration{
			ObjectMeta: metav1.ObjectMeta{Name: admission.MutatingPolicyName},
			Webhooks:   []admissionregistrationv1.MutatingWebhook{{Name: entry}},
		}); err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		r, err := New(ctx, kubetest.Wrap(client), Options{}).Manifest(ctx, strings.NewReader(manifest), "shop")
		if err != nil {
			t.Fatal(err)
		}
		ours := entry == admission.WebhookName
		if !r.Admission.Known || r.Admission.GatePolicy || r.Admission.GateWebhook != ours || len(r.Pods) != 1 || r.Pods[0].Gated != ours {
			t.Errorf("entry %s: admission %+v pods %+v notes %q", entry, r.Admission, r.Pods, r.Notes)
		}
		if ours && r.Pods[0].Gate != "added at admission by the webhook "+admission.WebhookName {
			t.Errorf("gate %q", r.Pods[0].Gate)
		}
	}
}
