package podmeta

import (
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Container names Istio's injector uses.
const (
	// ContainerProxy is the sidecar (a native sidecar in initContainers,
	// or a regular container).
	ContainerProxy = "istio-proxy"
	// ContainerInit programs the rules itself (NET_ADMIN): the injector's
	// choice when no node agent does it.
	ContainerInit = "istio-init"
	// ContainerValidation only checks that the node agent programmed them.
	ContainerValidation = "istio-validation"
)

// Trim returns the agent's informer transform: what the cache keeps of an
// object. A pod keeps its metadata (without managed fields) and only the
// spec and status fields some part of the agent reads:
//
//   - spec: nodeName, hostNetwork, serviceAccountName, readinessGates,
//     runtimeClassName (policy.CheckRuntime), and
//     of each container and init container its name; of a container named
//     istio-proxy also its env, args and securityContext (sidecar mode,
//     policy.ProxyInfo);
//   - status: phase, podIP, podIPs, initContainerStatuses (the repair
//     controller reads istio-validation's exit), and of the conditions
//     those whose type is one of conditions (the agent's own and
//     PodReadyToStartContainers).
//
// Everything else (volumes, images, probes, resources, tolerations, the
// containers' statuses, kubelet's other conditions, ...) is dropped: at a
// thousand pods it is most of the agent's heap (docs/scale.md). The agent
// never writes a cached pod back (it patches), so nothing dropped here can
// be lost. A namespace keeps its name, uid, resourceVersion, labels and
// deletion timestamp — the policy reads its labels only; its annotations
// (kubectl's last-applied configuration among them), spec and status go:
// every agent holds every namespace. Other objects lose their managed
// fields only.
//
// A reader of a new pod field adds it here; TestTrimKeepsWhatTheAgentReads
// compares every reader's answer on a trimmed pod with its answer on the
// full one.
func Trim(conditions ...corev1.PodConditionType) func(obj any) (any, error) {
	return func(obj any) (any, error) {
		if ns, ok := obj.(*corev1.Namespace); ok {
			return &corev1.Namespace{TypeMeta: ns.TypeMeta, ObjectMeta: metav1.ObjectMeta{
				Name: ns.Name, UID: ns.UID, ResourceVersion: ns.ResourceVersion,
				Labels: ns.Labels, DeletionTimestamp: ns.DeletionTimestamp,
			}}, nil
		}
		p, ok := obj.(*corev1.Pod)
		if !ok {
			if m, err := meta.Accessor(obj); err == nil {
				m.SetManagedFields(nil)
			}
			return obj, nil
		}
		out := &corev1.Pod{TypeMeta: p.TypeMeta, ObjectMeta: p.ObjectMeta}
		out.ManagedFields = nil
		out.Spec = corev1.PodSpec{
			NodeName:           p.Spec.NodeName,
			HostNetwork:        p.Spec.HostNetwork,
			ServiceAccountName: p.Spec.ServiceAccountName,
			ReadinessGates:     p.Spec.ReadinessGates,
			RuntimeClassName:   p.Spec.RuntimeClassName,
			InitContainers:     trimContainers(p.Spec.InitContainers),
			Containers:         trimContainers(p.Spec.Containers),
		}
		out.Status = corev1.PodStatus{
			Phase:                 p.Status.Phase,
			PodIP:                 p.Status.PodIP,
			PodIPs:                p.Status.PodIPs,
			InitContainerStatuses: p.Status.InitContainerStatuses,
		}
		for _, c := range p.Status.Conditions {
			if slices.Contains(conditions, c.Type) {
				out.Status.Conditions = append(out.Status.Conditions, c)
			}
		}
		return out, nil
	}
}

// trimContainers keeps each container's name, and istio-proxy's env, args
// and securityContext.
func trimContainers(cs []corev1.Container) []corev1.Container {
	if len(cs) == 0 {
		return nil
	}
	out := make([]corev1.Container, len(cs))
	for i, c := range cs {
		out[i].Name = c.Name
		if c.Name == ContainerProxy {
			out[i].Env, out[i].Args, out[i].SecurityContext = c.Env, c.Args, c.SecurityContext
		}
	}
	return out
}
