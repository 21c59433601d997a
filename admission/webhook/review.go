// Package webhook is `ambientd webhook`: a mutating admission webhook that
// adds the readiness gate to the pods the agent will enroll, for clusters
// without the MutatingAdmissionPolicy of deploy/pod-admission.yaml
// (admissionregistration.k8s.io/v1, Kubernetes 1.36+). It decides with the
// very function the policy's CEL is tested against (admission.Settings.Decide,
// judged by the case table admission/cases on the real kube-apiserver), and
// answers with the JSONPatch the policy's mutation writes.
//
// The package has three parts: the AdmissionReview handler (review.go), where
// its inputs come from (sources.go: the agent's ConfigMap and namespace
// labels) and the serving certificate, kept by the webhook itself (certs.go:
// a CA in a Secret, the webhook configuration's caBundle, leaves rotated in
// memory).
package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"slices"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/admission"
)

// MaxReviewBytes bounds a request body. The apiserver refuses objects over
// 3 MiB (its request body limit), and a pod CREATE's review carries the pod
// once (no oldObject): 4 MiB is above every review it can send, and a body
// over it is not one.
const MaxReviewBytes = 4 << 20

// Path is where the handler is served (the webhook configuration's
// clientConfig.service.path).
const Path = "/mutate-pods"

// Inputs are what a decision needs besides the pod.
type Inputs interface {
	// Settings returns the agent's settings from its ConfigMap; ok=false
	// when there is no ConfigMap (the policy's parameterNotFoundAction:
	// Allow — nothing is added).
	Settings() (s admission.Settings, ok bool)
	// NamespaceLabels returns the labels of namespace name.
	NamespaceLabels(ctx context.Context, name string) (map[string]string, error)
}

// Handler answers admission.k8s.io/v1 AdmissionReviews of pod creations.
// It never refuses a pod: every answer is allowed, with the gate's patch or
// without one (a warning says why when the webhook could not decide). A
// body that is not an AdmissionReview gets HTTP 400 and the reason.
type Handler struct {
	Inputs Inputs
	// Never lists namespaces whose pods are never mutated, whatever the
	// webhook configuration sends (kube-system, the agent's own): the
	// configuration's namespaceSelector keeps them away, this keeps them
	// safe when it is edited.
	Never []string
	// Timeout bounds one decision (the namespace lookup); default 5 s.
	Timeout time.Duration
	Log     *slog.Logger
	Metrics *Metrics
}

var podGVK = metav1.GroupVersionKind{Group: "", Version: "v1", Kind: "Pod"}
var podGVR = metav1.GroupVersionResource{Group: "", Version: "v1", Resource: "pods"}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	review, status, err := readReview(w, r)
	if err != nil {
		h.Metrics.observe("bad_request")
		h.log().Warn("admission review refused", "code", status, "error", err)
		http.Error(w, err.Error(), status)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.timeout())
	defer cancel()
	resp, outcome := h.review(ctx, review.Request)
	h.Metrics.observe(outcome)
	out := admissionv1.AdmissionReview{TypeMeta: review.TypeMeta, Response: resp}
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(out); err != nil {
		h.log().Warn("admission review: write response", "error", err)
	}
}

// readReview decodes the body as an admission.k8s.io/v1 AdmissionReview with
// a request; the HTTP status to answer when it is not one.
func readReview(w http.ResponseWriter, r *http.Request) (*admissionv1.AdmissionReview, int, error) {
	if r.Method != http.MethodPost {
		return nil, http.StatusMethodNotAllowed, fmt.Errorf("method %s: want POST", r.Method)
	}
	if ct, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || ct != "application/json" {
		return nil, http.StatusUnsupportedMediaType, fmt.Errorf("content type %q: want application/json", r.Header.Get("Content-Type"))
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxReviewBytes))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return nil, http.StatusRequestEntityTooLarge, fmt.Errorf("body over %d bytes: not an admission review", MaxReviewBytes)
	case err != nil:
		return nil, http.StatusBadRequest, fmt.Errorf("read body: %w", err)
	}
	var review admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &review); err != nil {
		return nil, http.StatusBadRequest, fmt.Errorf("body is not an AdmissionReview: %w", err)
	}
	if gv := review.APIVersion; gv != admissionv1.SchemeGroupVersion.String() || review.Kind != "AdmissionReview" {
		return nil, http.StatusBadRequest, fmt.Errorf("apiVersion %q kind %q: want %s AdmissionReview", gv, review.Kind, admissionv1.SchemeGroupVersion)
	}
	if review.Request == nil || review.Request.UID == "" {
		return nil, http.StatusBadRequest, errors.New("admission review without a request (or its uid)")
	}
	return &review, 0, nil
}

// review decides one request. Outcomes (the metric's label): gated,
// unchanged, skipped (not a pod creation we handle, or a namespace we
// never touch), undecided (settings or namespace unknown).
func (h *Handler) review(ctx context.Context, req *admissionv1.AdmissionRequest) (*admissionv1.AdmissionResponse, string) {
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	// The apiserver sends what the configuration's rules match: pods,
	// CREATE. Anything else is a misconfiguration or a forged review:
	// never mutated.
	if req.Kind != podGVK || req.Resource != podGVR || req.SubResource != "" || req.Operation != admissionv1.Create {
		resp.Warnings = []string{fmt.Sprintf("ambientd webhook: %s %s/%s (%s) is not a pod creation: not mutated", req.Operation, req.Kind.Kind, req.Resource.Resource, req.SubResource)}
		return resp, "skipped"
	}
	if slices.Contains(h.Never, req.Namespace) {
		return resp, "skipped"
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil || pod.Kind != "" && pod.Kind != "Pod" {
		resp.Warnings = []string{"ambientd webhook: the object is not a pod: not mutated"}
		return resp, "skipped"
	}
	// The policy decides by request.namespace; so does this.
	pod.Namespace = req.Namespace
	settings, ok := h.Inputs.Settings()
	if !ok {
		return resp, "unchanged"
	}
	labels, err := h.Inputs.NamespaceLabels(ctx, req.Namespace)
	if err != nil {
		h.log().Warn("admission: namespace unknown, pod not gated", "namespace", req.Namespace, "error", err)
		resp.Warnings = []string{fmt.Sprintf("ambientd webhook: namespace %s: %v: readiness gate not added", req.Namespace, err)}
		return resp, "undecided"
	}
	d := settings.Decide(&pod, labels)
	if !d.AddGate {
		return resp, "unchanged"
	}
	patch, err := json.Marshal(GatePatch(&pod, settings.ConditionType))
	if err != nil { // cannot happen: strings only
		return resp, "undecided"
	}
	pt := admissionv1.PatchTypeJSONPatch
	resp.Patch, resp.PatchType = patch, &pt
	return resp, "gated"
}

// PatchOp is one JSONPatch (RFC 6902) operation.
type PatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// GatePatch is the JSONPatch that appends the gate conditionType to pod's
// spec.readinessGates — the policy's mutation: the pod's own gates stay, in
// order.
func GatePatch(pod *corev1.Pod, conditionType string) []PatchOp {
	gate := corev1.PodReadinessGate{ConditionType: corev1.PodConditionType(conditionType)}
	if len(pod.Spec.ReadinessGates) == 0 {
		return []PatchOp{{Op: "add", Path: "/spec/readinessGates", Value: []corev1.PodReadinessGate{gate}}}
	}
	return []PatchOp{{Op: "add", Path: "/spec/readinessGates/-", Value: gate}}
}

func (h *Handler) timeout() time.Duration {
	if h.Timeout > 0 {
		return h.Timeout
	}
	return 5 * time.Second
}

func (h *Handler) log() *slog.Logger {
	if h.Log != nil {
		return h.Log
	}
	return slog.Default()
}
