package agent

import corev1 "k8s.io/api/core/v1"

// awaitsCondition reports whether pod names the agent's condition in
// spec.readinessGates and shows no such condition yet. Kubelet counts the
// missing condition as False, so the pod stays NotReady until someone writes
// it — and the agent is the only writer. publish therefore writes
// True/NotInMesh for such a pod even when the agent never enrolled it
// (labelled `none` after admission added the gate, gated by hand outside the
// mesh, a sidecar injected after the gate, settings that differ between the
// admission policy and the agent): a gate never holds a pod NotReady for a
// reason the mesh does not have (the no-deadlock rule, docs/readiness.md).
func (a *Agent) awaitsCondition(pod *corev1.Pod) bool {
	if podCondition(pod, a.cfg.PodConditionType) != nil {
		return false
	}
	for _, g := range pod.Spec.ReadinessGates {
		if string(g.ConditionType) == a.cfg.PodConditionType {
			return true
		}
	}
	return false
}
