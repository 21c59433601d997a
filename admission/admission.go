// Package admission is the Go twin of the pod admission policies shipped in
// deploy/pod-admission.yaml: whether the MutatingAdmissionPolicy adds the
// readiness gate to a pod being created (Decide, Gates), with the same
// settings the policy reads from the agent's ConfigMap (SettingsFrom). The
// agent's enrollment rules themselves live in policy; the
// annotation rules in podmeta. `ambientd inject` and `ambientd
// check` (admission/inject, admission/check) decide with this package, and
// the case tables in admission/cases run against it and against the shipped
// CEL on a real kube-apiserver, so the two cannot drift apart unnoticed.
package admission

import (
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// The gate's opt-out: this label set to "false" on a pod (or pod template)
// or on its namespace keeps the readiness gate away; the pod is still
// enrolled by the agent.
const (
	LabelReadinessGate = "ambient.istio.io/readiness-gate"
	OptOutValue        = "false"
)

// Names of what deploy/ installs, for `ambientd check`.
const (
	MutatingPolicyName    = "ambientd-readiness-gate"
	ValidatingPolicyName  = "ambientd-pod-annotations"
	ConfigMapName         = "ambientd-config"
	DefaultAgentNamespace = "istio-system"
	// WebhookName is the entry of the MutatingWebhookConfiguration
	// MutatingPolicyName that `ambientd webhook` serves (clusters before
	// Kubernetes 1.36).
	WebhookName = "readiness-gate.ambientd.io"
)

// The agent's environment variables the policy reads from its ConfigMap.
const (
	EnvExcludeNamespaces = "AMBIENTD_EXCLUDE_NAMESPACES"
	EnvSystemNamespace   = "AMBIENTD_SYSTEM_NAMESPACE"
	EnvConditionType     = "AMBIENTD_POD_CONDITION_TYPE"
)

// Settings are the agent settings admission depends on.
type Settings struct {
	Policy        policy.Config
	ConditionType string
}

// DefaultSettings are the agent's defaults.
func DefaultSettings() Settings {
	return Settings{Policy: policy.DefaultConfig(), ConditionType: podmeta.ConditionEnrolled}
}

// SettingsFrom reads the settings from the agent's ConfigMap data the way the
// agent reads its environment: a missing or empty value means the default.
// The shipped policy's CEL does the same.
func SettingsFrom(data map[string]string) Settings {
	s := DefaultSettings()
	if v := data[EnvConditionType]; v != "" {
		s.ConditionType = v
	}
	if v := data[EnvSystemNamespace]; v != "" {
		s.Policy.SystemNamespace = v
	}
	if v := data[EnvExcludeNamespaces]; v != "" {
		s.Policy.ExcludeNamespaces = nil
		for _, n := range strings.Split(v, ",") {
			if n = strings.TrimSpace(n); n != "" {
				s.Policy.ExcludeNamespaces = append(s.Policy.ExcludeNamespaces, n)
			}
		}
	}
	return s
}

// Decision is what admission does with a pod being created.
type Decision struct {
	// Policy is the agent's verdict on the pod as created (policy).
	Policy policy.Decision
	// HasGate: the pod already names the condition in spec.readinessGates.
	HasGate bool
	// OptOut says where the gate opt-out label was found: "pod",
	// "namespace", or "" (none).
	OptOut string
	// AddGate: the mutating policy adds the gate.
	AddGate bool
}

// Decide says what the shipped MutatingAdmissionPolicy does with pod (as
// submitted, or a workload's pod template with its namespace filled in),
// given its namespace's labels.
func (s Settings) Decide(pod *corev1.Pod, nsLabels map[string]string) Decision {
	d := Decision{Policy: s.Policy.Decide(pod, nsLabels)}
	d.HasGate = slices.ContainsFunc(pod.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool {
		return string(g.ConditionType) == s.ConditionType
	})
	switch {
	case pod.Labels[LabelReadinessGate] == OptOutValue:
		d.OptOut = "pod"
	case nsLabels[LabelReadinessGate] == OptOutValue:
		d.OptOut = "namespace"
	}
	d.AddGate = d.Policy.InMesh && !d.HasGate && d.OptOut == ""
	return d
}

// Gates returns pod's spec.readinessGates after admission: the pod's own,
// in order, and the condition appended when d.AddGate.
func (s Settings) Gates(pod *corev1.Pod, d Decision) []corev1.PodReadinessGate {
	out := slices.Clone(pod.Spec.ReadinessGates)
	if d.AddGate {
		out = append(out, corev1.PodReadinessGate{ConditionType: corev1.PodConditionType(s.ConditionType)})
	}
	return out
}
