package webhook

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/cases"
	"github.com/ambientd/ambientd/test/infra/kubetest"
)

// fixedInputs are a ConfigMap's data and namespaces' labels.
type fixedInputs struct {
	data       map[string]string // nil: no ConfigMap
	namespaces map[string]map[string]string
	block      bool // NamespaceLabels waits for its context
}

func (f fixedInputs) Settings() (admission.Settings, bool) {
	if f.data == nil {
		return admission.Settings{}, false
	}
	return admission.SettingsFrom(f.data), true
}

func (f fixedInputs) NamespaceLabels(ctx context.Context, name string) (map[string]string, error) {
	if f.block {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	l, ok := f.namespaces[name]
	if !ok {
		return nil, errors.New("not found")
	}
	return l, nil
}

func reviewOf(t *testing.T, pod *corev1.Pod, mutate func(*admissionv1.AdmissionRequest)) []byte {
	t.Helper()
	raw, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	req := &admissionv1.AdmissionRequest{
		UID: types.UID("uid-1"), Kind: podGVK, Resource: podGVR, Operation: admissionv1.Create,
		Namespace: pod.Namespace, Object: runtime.RawExtension{Raw: raw},
	}
	if mutate != nil {
		mutate(req)
	}
	b, err := json.Marshal(admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Request: req,
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func post(h http.Handler, body []byte, contentType string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(body))
	r.Header.Set("Content-Type", contentType)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// admit runs pod through the handler and applies its patch, as the
// apiserver does; it returns the pod as admitted.
func admit(t *testing.T, h http.Handler, pod *corev1.Pod, mutate func(*admissionv1.AdmissionRequest)) (*corev1.Pod, *admissionv1.AdmissionResponse) {
	t.Helper()
	w := post(h, reviewOf(t, pod, mutate), "application/json")
	if w.Code != http.StatusOK {
		t.Fatalf("HTTP %d: %s", w.Code, w.Body)
	}
	var out admissionv1.AdmissionReview
	if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil {
		t.Fatal(err)
	}
	resp := out.Response
	if resp == nil || resp.UID != "uid-1" || !resp.Allowed {
		t.Fatalf("response %+v: want allowed, uid-1", resp)
	}
	raw, _ := json.Marshal(pod)
	if resp.Patch != nil {
		if resp.PatchType == nil || *resp.PatchType != admissionv1.PatchTypeJSONPatch {
			t.Fatalf("patch type %v", resp.PatchType)
		}
		p, err := jsonpatch.DecodePatch(resp.Patch)
		if err != nil {
			t.Fatalf("patch %s: %v", resp.Patch, err)
		}
		if raw, err = p.Apply(raw); err != nil {
			t.Fatalf("apply %s: %v", resp.Patch, err)
		}
	}
	var got corev1.Pod
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	return &got, resp
}

func gates(p *corev1.Pod) []string {
	out := []string{}
	for _, g := range p.Spec.ReadinessGates {
		out = append(out, string(g.ConditionType))
	}
	return out
}

// TestWebhookFollowsTheEnrollmentTable: the webhook admits every pod of
// admission/cases/enrollment.yaml — the table the shipped
// MutatingAdmissionPolicy passes on the real apiserver — with exactly the
// table's gates, and admitting the admitted pod again changes nothing (the
// apiserver reinvokes webhooks; never a duplicate gate).
func TestWebhookFollowsTheEnrollmentTable(t *testing.T) {
	e, err := cases.LoadEnrollment()
	if err != nil {
		t.Fatal(err)
	}
	shipped := kubetest.ShippedConfig(t, "../../deploy/configmap.yaml")
	labels := map[string]map[string]string{}
	for _, n := range e.Namespaces {
		labels[n.Name] = n.Labels
	}
	for _, c := range e.Cases {
		t.Run(c.Name, func(t *testing.T) {
			data := maps.Clone(shipped)
			maps.Copy(data, c.Settings)
			h := &Handler{Inputs: fixedInputs{data: data, namespaces: labels}}
			got, _ := admit(t, h, &c.Pod, nil)
			if g := gates(got); !slices.Equal(g, append([]string{}, c.Gates...)) {
				t.Fatalf("gates %q, table says %q", g, c.Gates)
			}
			again, resp := admit(t, h, got, nil)
			if resp.Patch != nil || !slices.Equal(gates(again), gates(got)) {
				t.Errorf("second admission patched %s: gates %q", resp.Patch, gates(again))
			}
		})
	}
}

// TestWebhookNeverMutatesWhatItMustNot: the attacks and accidents — a
// review forged or misrouted for another kind, resource, subresource or
// operation, a pod in a namespace the webhook never touches (kube-system,
// the agent's own) even when the configuration sends it, no ConfigMap, an
// unknown namespace — are all allowed unchanged (never refused: pod
// creation must not depend on the webhook).
func TestWebhookNeverMutatesWhatItMustNot(t *testing.T) {
	ns := map[string]map[string]string{
		"shop": {"istio.io/dataplane-mode": "ambient"}, "kube-system": {"istio.io/dataplane-mode": "ambient"},
		"istio-system": {"istio.io/dataplane-mode": "ambient"},
	}
	h := &Handler{Inputs: fixedInputs{data: map[string]string{}, namespaces: ns}, Never: []string{"kube-system", "istio-system"}}
	pod := func(nsName string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: nsName, Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}
	}
	if got, _ := admit(t, h, pod("shop"), nil); len(got.Spec.ReadinessGates) != 1 {
		t.Fatalf("the control case is not gated: %q", gates(got))
	}
	for _, tc := range []struct {
		name    string
		h       *Handler
		pod     *corev1.Pod
		mutate  func(*admissionv1.AdmissionRequest)
		warning string
	}{
		{name: "kube-system", h: h, pod: pod("kube-system")},
		{name: "the agent's namespace", h: h, pod: pod("istio-system")},
		{name: "kind Deployment", h: h, pod: pod("shop"), warning: "not a pod creation",
			mutate: func(r *admissionv1.AdmissionRequest) {
				r.Kind = metav1.GroupVersionKind{Group: "apps", Version: "v1", Kind: "Deployment"}
			}},
		{name: "resource deployments", h: h, pod: pod("shop"), warning: "not a pod creation",
			mutate: func(r *admissionv1.AdmissionRequest) { r.Resource.Resource = "deployments" }},
		{name: "subresource status", h: h, pod: pod("shop"), warning: "not a pod creation",
			mutate: func(r *admissionv1.AdmissionRequest) { r.SubResource = "status" }},
		{name: "UPDATE", h: h, pod: pod("shop"), warning: "not a pod creation",
			mutate: func(r *admissionv1.AdmissionRequest) { r.Operation = admissionv1.Update }},
		{name: "object of another kind", h: h, pod: pod("shop"), warning: "not a pod",
			mutate: func(r *admissionv1.AdmissionRequest) {
				r.Object.Raw = []byte(`{"kind":"Secret","apiVersion":"v1","metadata":{"labels":{"istio.io/dataplane-mode":"ambient"}}}`)
			}},
		{name: "object not JSON", h: h, pod: pod("shop"), warning: "not a pod",
			mutate: func(r *admissionv1.AdmissionRequest) { r.Object.Raw = []byte(`"x"`) }},
		{name: "no ConfigMap", h: &Handler{Inputs: fixedInputs{namespaces: ns}}, pod: pod("shop")},
		{name: "unknown namespace", h: h, pod: pod("nowhere"), warning: "readiness gate not added"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, resp := admit(t, tc.h, tc.pod, tc.mutate)
			if resp.Patch != nil || len(got.Spec.ReadinessGates) != 0 {
				t.Errorf("mutated: patch %s", resp.Patch)
			}
			if tc.warning != "" && !strings.Contains(strings.Join(resp.Warnings, ";"), tc.warning) {
				t.Errorf("warnings %q: want one saying %q", resp.Warnings, tc.warning)
			}
		})
	}
}

// TestWebhookRefusesWhatIsNotAReview: a body that is not an
// admission.k8s.io/v1 AdmissionReview gets a 4xx naming the problem, and a
// huge one is cut off at MaxReviewBytes rather than read whole.
func TestWebhookRefusesWhatIsNotAReview(t *testing.T) {
	h := &Handler{Inputs: fixedInputs{data: map[string]string{}}}
	valid := reviewOf(t, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "x"}}, nil)
	for _, tc := range []struct {
		name, contentType string
		body              []byte
		code              int
		says              string
	}{
		{"malformed", "application/json", []byte(`{"apiVersion":`), 400, "not an AdmissionReview"},
		{"v1beta1", "application/json", bytes.Replace(valid, []byte(`admission.k8s.io/v1`), []byte(`admission.k8s.io/v1beta1`), 1), 400, "want admission.k8s.io/v1"},
		{"another kind", "application/json", bytes.Replace(valid, []byte(`"AdmissionReview"`), []byte(`"Pod"`), 1), 400, "want admission.k8s.io/v1"},
		{"no request", "application/json", []byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}`), 400, "without a request"},
		{"not JSON", "text/plain", valid, 415, "want application/json"},
		{"huge", "application/json", append(append([]byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","x":"`), bytes.Repeat([]byte("a"), MaxReviewBytes)...), `"}`...), 413, "over"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := post(h, tc.body, tc.contentType)
			if w.Code != tc.code || !strings.Contains(w.Body.String(), tc.says) {
				t.Errorf("HTTP %d %q: want %d saying %q", w.Code, w.Body, tc.code, tc.says)
			}
		})
	}
	r := httptest.NewRequest(http.MethodGet, Path, nil)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET: HTTP %d", w.Code)
	}
}

// TestWebhookAnswersWithinItsTimeout: a namespace lookup that hangs does
// not hang the review: it is answered (allowed, not gated) at the timeout,
// well before the apiserver's own webhook timeout.
func TestWebhookAnswersWithinItsTimeout(t *testing.T) {
	h := &Handler{Inputs: fixedInputs{data: map[string]string{}, block: true}, Timeout: 200 * time.Millisecond}
	start := time.Now()
	got, resp := admit(t, h, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "slow", Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}, nil)
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("answered after %s", d)
	}
	if resp.Patch != nil || len(got.Spec.ReadinessGates) != 0 || len(resp.Warnings) == 0 {
		t.Errorf("patch %s, warnings %q: want none and a warning", resp.Patch, resp.Warnings)
	}
}
