package helm

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/ambientd/ambientd/test/helm/chartrender"
)

// gateObjects renders the chart and returns kind/name of every object that
// adds the readiness gate (the policy, its binding, the webhook's pieces).
func gateObjects(t *testing.T, kube string, set ...string) []string {
	t.Helper()
	var out []string
	for _, o := range render(t, chartrender.Options{Namespace: "istio-system", KubeVersion: kube, Set: set}) {
		switch k := o.GetKind(); {
		case k == "MutatingAdmissionPolicy", k == "MutatingAdmissionPolicyBinding", k == "MutatingWebhookConfiguration",
			k == "PodDisruptionBudget", k == "Certificate", k == "Issuer",
			strings.HasPrefix(o.GetName(), "ambientd-webhook"):
			out = append(out, k+"/"+o.GetName())
		}
	}
	slices.Sort(out)
	return out
}

var (
	policyObjects  = []string{"MutatingAdmissionPolicy/ambientd-readiness-gate", "MutatingAdmissionPolicyBinding/ambientd-readiness-gate"}
	webhookObjects = []string{
		"ClusterRole/ambientd-webhook", "ClusterRoleBinding/ambientd-webhook", "Deployment/ambientd-webhook",
		"MutatingWebhookConfiguration/ambientd-readiness-gate", "PodDisruptionBudget/ambientd-webhook", "Role/ambientd-webhook",
		"RoleBinding/ambientd-webhook", "Secret/ambientd-webhook-ca", "Service/ambientd-webhook", "ServiceAccount/ambientd-webhook",
	}
)

// TestGateMechanismFollowsTheKubernetesVersion: by default the chart adds
// the gate with the MutatingAdmissionPolicy where the server has it
// (Kubernetes 1.36+) and with the webhook before — never both, never
// neither — and readinessGate.mechanism overrides the choice.
func TestGateMechanismFollowsTheKubernetesVersion(t *testing.T) {
	for _, tc := range []struct {
		kube, mechanism string
		want            []string
	}{
		{"v1.33.0", "", webhookObjects},
		{"v1.35.4", "", webhookObjects},
		{"v1.36.0", "", policyObjects},
		{"v1.37.0", "", policyObjects},
		{"v1.37.0", "webhook", webhookObjects},
		{"v1.33.0", "policy", policyObjects},
		{"v1.33.0", "none", nil},
		{"v1.37.0", "none", nil},
	} {
		t.Run(tc.kube+"/"+tc.mechanism, func(t *testing.T) {
			var set []string
			if tc.mechanism != "" {
				set = []string{"ambientd.readinessGate.mechanism=" + tc.mechanism}
			}
			if got := gateObjects(t, tc.kube, set...); !slices.Equal(got, tc.want) {
				t.Errorf("rendered %q, want %q", got, tc.want)
			}
		})
	}
	if _, err := chartrender.Render(chartDir, chartrender.Options{Set: []string{"ambientd.readinessGate.mechanism=sometimes"}}); err == nil || !strings.Contains(err.Error(), "mechanism") {
		t.Errorf("an unknown mechanism: error %v, want one naming it", err)
	}
}

// TestMissingGateEventsFollowTheMechanism: with no admission adding the
// gate on purpose (mechanism none) the agent records no ReadinessGateMissing
// Event per mesh pod; with a mechanism, a pod without the gate is an
// anomaly it reports.
func TestMissingGateEventsFollowTheMechanism(t *testing.T) {
	for mechanism, want := range map[string]string{"": "true", "webhook": "true", "policy": "true", "none": "false"} {
		var set []string
		if mechanism != "" {
			set = []string{"ambientd.readinessGate.mechanism=" + mechanism}
		}
		var cm corev1.ConfigMap
		typed(t, objectsOf(t, chartDir, chartrender.Options{Release: "ambientd", Namespace: "istio-system", KubeVersion: "v1.37.0", Set: set}), "ConfigMap", "ambientd-config", &cm)
		if got := cm.Data["AMBIENTD_MISSING_GATE_EVENTS"]; got != want {
			t.Errorf("mechanism %q: AMBIENTD_MISSING_GATE_EVENTS %q, want %q", mechanism, got, want)
		}
	}
}

func typed[T runtime.Object](t *testing.T, objs chartObjects, kind, name string, into T) T {
	t.Helper()
	if !objs.get(t, kind, name, into) {
		t.Fatalf("no %s %s rendered", kind, name)
	}
	return into
}

// TestWebhookScopeAndRights: the webhook configuration never sends pods of
// kube-system or the release's namespace, honours the opt-out label, sees
// pod creations only and never blocks them (failurePolicy Ignore); the
// Deployment runs 2 replicas under a PodDisruptionBudget; and its rights
// name exactly its own Secret and its own configuration — nothing lets it
// write another webhook's caBundle or read another Secret.
func TestWebhookScopeAndRights(t *testing.T) {
	objs := objectsOf(t, chartDir, chartrender.Options{Namespace: "mesh", KubeVersion: "v1.33.0"})
	cfg := typed(t, objs, "MutatingWebhookConfiguration", "ambientd-readiness-gate", &admissionregistrationv1.MutatingWebhookConfiguration{})
	if len(cfg.Webhooks) != 1 {
		t.Fatalf("%d webhooks", len(cfg.Webhooks))
	}
	w := cfg.Webhooks[0]
	if w.FailurePolicy == nil || *w.FailurePolicy != admissionregistrationv1.Ignore || w.SideEffects == nil || *w.SideEffects != admissionregistrationv1.SideEffectClassNone {
		t.Errorf("failurePolicy %v sideEffects %v: want Ignore, None", w.FailurePolicy, w.SideEffects)
	}
	if len(w.Rules) != 1 || fmt.Sprint(w.Rules[0].Operations, w.Rules[0].Resources) != "[CREATE] [pods]" {
		t.Errorf("rules %+v: want pod creations only", w.Rules)
	}
	if s := w.ClientConfig.Service; s == nil || s.Namespace != "mesh" || s.Name != "ambientd-webhook" || s.Path == nil || *s.Path != "/mutate-pods" {
		t.Errorf("clientConfig %+v", w.ClientConfig)
	}
	never := map[string]bool{}
	optOut := false
	for _, e := range w.NamespaceSelector.MatchExpressions {
		if e.Key == "kubernetes.io/metadata.name" && e.Operator == "NotIn" {
			for _, v := range e.Values {
				never[v] = true
			}
		}
		optOut = optOut || e.Key == "ambient.istio.io/readiness-gate" && e.Operator == "NotIn" && slices.Equal(e.Values, []string{"false"})
	}
	if !never["kube-system"] || !never["mesh"] || !optOut {
		t.Errorf("namespaceSelector %+v: want kube-system and the release namespace out, and the opt-out", w.NamespaceSelector)
	}
	dep := typed(t, objs, "Deployment", "ambientd-webhook", &appsv1.Deployment{})
	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 2 || !slices.Equal(dep.Spec.Template.Spec.Containers[0].Args, []string{"webhook"}) {
		t.Errorf("Deployment: replicas %v args %v", dep.Spec.Replicas, dep.Spec.Template.Spec.Containers[0].Args)
	}
	role := typed(t, objs, "Role", "ambientd-webhook", &rbacv1.Role{})
	cr := typed(t, objs, "ClusterRole", "ambientd-webhook", &rbacv1.ClusterRole{})
	for _, r := range append(role.Rules, cr.Rules...) {
		write := slices.ContainsFunc(r.Verbs, func(v string) bool { return v != "get" && v != "list" && v != "watch" })
		switch {
		case slices.Contains(r.Resources, "namespaces"):
			if write {
				t.Errorf("writes namespaces: %+v", r)
			}
		case slices.Equal(r.Resources, []string{"secrets"}):
			if !slices.Equal(r.ResourceNames, []string{"ambientd-webhook-ca"}) {
				t.Errorf("secrets rule %+v: want its own Secret by name", r)
			}
		case slices.Equal(r.Resources, []string{"mutatingwebhookconfigurations"}):
			if !slices.Equal(r.ResourceNames, []string{"ambientd-readiness-gate"}) {
				t.Errorf("configuration rule %+v: want its own by name", r)
			}
		case slices.Equal(r.Resources, []string{"configmaps"}):
			if write || !slices.Equal(r.ResourceNames, []string{"ambientd-config"}) {
				t.Errorf("configmaps rule %+v: want the agent's, read only", r)
			}
		default:
			t.Errorf("unexpected rule %+v", r)
		}
	}
}

// TestWebhookWithCertManager: certificates=cert-manager renders a
// Certificate (a self-signed Issuer unless one is named) and the CA
// injector's annotation instead of the webhook's own CA Secret, and takes
// away the rights the webhook then does not need.
func TestWebhookWithCertManager(t *testing.T) {
	set := []string{"ambientd.readinessGate.mechanism=webhook", "ambientd.readinessGate.webhook.certificates=cert-manager"}
	got := gateObjects(t, "v1.37.0", set...)
	for _, want := range []string{"Certificate/ambientd-webhook", "Issuer/ambientd-webhook"} {
		if !slices.Contains(got, want) {
			t.Errorf("no %s in %q", want, got)
		}
	}
	if slices.Contains(got, "Secret/ambientd-webhook-ca") {
		t.Error("the self-kept CA Secret is rendered with cert-manager")
	}
	objs := objectsOf(t, chartDir, chartrender.Options{Namespace: "istio-system", KubeVersion: "v1.37.0", Set: set})
	cfg := typed(t, objs, "MutatingWebhookConfiguration", "ambientd-readiness-gate", &admissionregistrationv1.MutatingWebhookConfiguration{})
	if a := cfg.Annotations["cert-manager.io/inject-ca-from"]; a != "istio-system/ambientd-webhook" {
		t.Errorf("inject-ca-from %q", a)
	}
	for _, kind := range []string{"Role", "ClusterRole"} {
		var r rbacv1.ClusterRole
		objs.get(t, kind, "ambientd-webhook", &r)
		for _, rule := range r.Rules {
			if slices.Contains(rule.Verbs, "update") {
				t.Errorf("%s: %+v: the webhook writes nothing with cert-manager", kind, rule)
			}
		}
	}
	dep := typed(t, objs, "Deployment", "ambientd-webhook", &appsv1.Deployment{})
	env := map[string]string{}
	for _, e := range dep.Spec.Template.Spec.Containers[0].Env {
		env[e.Name] = e.Value
	}
	if env["AMBIENTD_WEBHOOK_MANAGE_CERTIFICATES"] != "false" || len(dep.Spec.Template.Spec.Volumes) != 1 {
		t.Errorf("Deployment: env %v, volumes %v: want the cert-manager Secret mounted and certificates not managed", env, dep.Spec.Template.Spec.Volumes)
	}
	with := gateObjects(t, "v1.37.0", append(set, "ambientd.readinessGate.webhook.certManagerIssuer.kind=ClusterIssuer", "ambientd.readinessGate.webhook.certManagerIssuer.name=corp-ca")...)
	if slices.Contains(with, "Issuer/ambientd-webhook") {
		t.Error("a self-signed Issuer rendered though an issuer is named")
	}
}
