// Package policy decides, in one place, which data plane a pod gets from
// this node agent: the ambient mesh (rules to ztunnel), sidecar capture
// (rules to the pod's own istio-proxy, Istio's injector having added it), or
// nothing. It is pure: it looks only at the pod and its namespace's labels
// (and, in CheckRuntime, at the runtime handler the caller looked up),
// never at the cluster.
package policy

import (
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/podmeta"
)

// Reason says why a pod is or is not in the mesh; it is used as a metric label
// and in logs, so the set is small and fixed.
type Reason string

const (
	ReasonPodLabel          Reason = "pod-label"
	ReasonNamespaceLabel    Reason = "namespace-label"
	ReasonNotLabelled       Reason = "not-labelled"
	ReasonPodOptOut         Reason = "pod-opt-out"
	ReasonExcludedNamespace Reason = "excluded-namespace"
	ReasonHostNetwork       Reason = "host-network"
	ReasonSidecar           Reason = "sidecar"
	ReasonZtunnel           Reason = "ztunnel"
	ReasonSelf              Reason = "self"
	ReasonTerminal          Reason = "terminal"
)

// Decision is the outcome of Decide. At most one of InMesh and Sidecar is
// set.
type Decision struct {
	// InMesh: the ambient mesh (Reason says why, or why not).
	InMesh bool
	Reason Reason
	// Sidecar: the pod's traffic is captured for its injected istio-proxy
	// (Istio's istio-cni sidecar mode, see SidecarDecision).
	Sidecar bool
	// SidecarSkip, for a pod that looks injected but is not captured, is
	// why (Istio's own wording of its skip, for logs).
	SidecarSkip string
}

// Mode names the data plane decided: "ambient", "sidecar" or "none".
func (d Decision) Mode() string {
	switch {
	case d.InMesh:
		return "ambient"
	case d.Sidecar:
		return "sidecar"
	}
	return "none"
}

// Config holds what the policy needs besides the pod.
type Config struct {
	// ExcludeNamespaces are never enrolled (default kube-system).
	ExcludeNamespaces []string
	// SystemNamespace is where the mesh's own pods run (default
	// istio-system, as Istio): only there do ZtunnelLabels and SelfLabels
	// keep a pod out of the mesh. A user's pod labelled app=ztunnel in
	// another namespace is an ordinary pod. Empty: no namespace.
	SystemNamespace string
	// ZtunnelLabels identify ztunnel pods (all must match). Default app=ztunnel.
	ZtunnelLabels map[string]string
	// SelfLabels identify the agent's own pods (all must match). Default
	// app=ambientd.
	SelfLabels map[string]string
	// CapturableRuntimeHandlers are the runtime handlers (a RuntimeClass's
	// handler; NoRuntimeClass for pods without one) whose pods' traffic the
	// in-pod rules capture (CheckRuntime). A pod in the mesh under any
	// other handler is not enrolled and never reported in the mesh.
	// Default DefaultCapturableRuntimeHandlers.
	CapturableRuntimeHandlers []string
}

// IstioAgentPodPrefix names the pods of Istio's own node agent DaemonSet
// (istio-cni-node-*): in the system namespace, an injected one is skipped as
// Istio skips its own pods (ours are recognised by SelfLabels).
const IstioAgentPodPrefix = "istio-cni-node-"

// DefaultSystemNamespace is where Istio (and the shipped DaemonSet) runs
// ztunnel and the node agent.
const DefaultSystemNamespace = "istio-system"

// DefaultConfig returns the documented defaults.
func DefaultConfig() Config {
	return Config{
		ExcludeNamespaces: []string{"kube-system"},
		SystemNamespace:   DefaultSystemNamespace,
		ZtunnelLabels:     map[string]string{"app": "ztunnel"},
		SelfLabels:        map[string]string{"app": "ambientd"},

		CapturableRuntimeHandlers: DefaultCapturableRuntimeHandlers(),
	}
}

// Decide says which data plane pod gets, given its namespace's labels.
// The exclusions come first: no label can enroll a hostNetwork pod, ztunnel
// or the agent itself (in the system namespace), or a pod in an excluded
// namespace, in either mode. Terminal pods (Succeeded/Failed) are out: their
// network is about to go away. A pod Istio's injector gave a sidecar (the
// sidecar.istio.io/status annotation) is never ambient, whatever its labels
// (as in Istio); it is captured for its proxy when SidecarDecision says so.
func (c Config) Decide(pod *corev1.Pod, nsLabels map[string]string) Decision {
	switch {
	case slices.Contains(c.ExcludeNamespaces, pod.Namespace):
		return Decision{Reason: ReasonExcludedNamespace}
	case pod.Spec.HostNetwork:
		return Decision{Reason: ReasonHostNetwork}
	case c.system(pod) && matches(pod.Labels, c.ZtunnelLabels):
		return Decision{Reason: ReasonZtunnel}
	case c.system(pod) && matches(pod.Labels, c.SelfLabels):
		return Decision{Reason: ReasonSelf}
	case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		return Decision{Reason: ReasonTerminal}
	case hasKey(pod.Annotations, podmeta.AnnotationSidecarStatus):
		if c.system(pod) && strings.HasPrefix(pod.Name, IstioAgentPodPrefix) {
			return Decision{Reason: ReasonSelf, SidecarSkip: pod.Name + " looks like our own agent pod, skipping"}
		}
		capture, skip := SidecarDecision(pod)
		return Decision{Reason: ReasonSidecar, Sidecar: capture, SidecarSkip: skip}
	}
	switch pod.Labels[podmeta.LabelDataplaneMode] {
	case podmeta.ModeNone:
		return Decision{Reason: ReasonPodOptOut}
	case podmeta.ModeAmbient:
		return Decision{InMesh: true, Reason: ReasonPodLabel}
	}
	if nsLabels[podmeta.LabelDataplaneMode] == podmeta.ModeAmbient {
		return Decision{InMesh: true, Reason: ReasonNamespaceLabel}
	}
	d := Decision{Reason: ReasonNotLabelled}
	if _, ok := proxyContainer(pod); ok {
		// An istio-proxy without the status annotation: Istio skips it
		// (the last check of its order); say so in Istio's words.
		_, d.SidecarSkip = SidecarDecision(pod)
	}
	return d
}

// system reports whether pod runs in the system namespace.
func (c Config) system(pod *corev1.Pod) bool {
	return c.SystemNamespace != "" && pod.Namespace == c.SystemNamespace
}

func hasKey(m map[string]string, k string) bool {
	_, ok := m[k]
	return ok
}

// matches reports whether labels hold every pair of sel. An empty selector
// matches nothing, so an unset config never excludes every pod.
func matches(labels, sel map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}
