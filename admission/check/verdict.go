package check

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// decidedBy says in words what decided the policy's verdict d about p.
func (c *Checker) decidedBy(p *corev1.Pod, d policy.Decision) string {
	mode := podmeta.LabelDataplaneMode
	switch d.Reason {
	case policy.ReasonNamespaceLabel:
		return fmt.Sprintf("namespace %s: %s=%s", p.Namespace, mode, podmeta.ModeAmbient)
	case policy.ReasonPodLabel:
		return fmt.Sprintf("pod label %s=%s", mode, podmeta.ModeAmbient)
	case policy.ReasonPodOptOut:
		return fmt.Sprintf("pod label %s=%s", mode, podmeta.ModeNone)
	case policy.ReasonNotLabelled:
		return fmt.Sprintf("no %s=%s on the pod or namespace %s", mode, podmeta.ModeAmbient, p.Namespace)
	case policy.ReasonExcludedNamespace:
		return fmt.Sprintf("namespace %s is excluded (%s)", p.Namespace, admission.EnvExcludeNamespaces)
	case policy.ReasonHostNetwork:
		return "spec.hostNetwork: true"
	case policy.ReasonSidecar:
		return "annotation " + podmeta.AnnotationSidecarStatus + " (a sidecar pod)"
	case policy.ReasonZtunnel:
		return fmt.Sprintf("ztunnel (app=ztunnel in the system namespace %s)", p.Namespace)
	case policy.ReasonSelf:
		return fmt.Sprintf("the agent itself (app=ambientd in the system namespace %s)", p.Namespace)
	case policy.ReasonTerminal:
		return "pod phase " + string(p.Status.Phase)
	}
	return string(d.Reason)
}

// verdict sums an existing pod up.
func verdict(p Pod) (string, bool) {
	c := p.Condition
	noAgent := p.Agent != nil && !p.Agent.Serves
	switch {
	case p.Phase == string(corev1.PodSucceeded) || p.Phase == string(corev1.PodFailed):
		return "finished", false
	case !p.Enrolled && !p.Gated:
		return "not in the mesh", false
	case !p.Enrolled && c != nil && c.Status == string(corev1.ConditionTrue):
		return "not in the mesh; the agent released its gate (" + c.Reason + ")", false
	case !p.Enrolled && noAgent:
		return fmt.Sprintf("STUCK: gated, not in the mesh, and no agent on node %s writes its condition: stays NotReady (run the agent there or remove the gate)", p.Node), true
	case !p.Enrolled:
		return "not in the mesh; gated: the agent writes True/NotInMesh when it syncs the pod", false
	case p.AnnotationError != "":
		return "NOT MESHED: the agent refuses its annotations: " + p.AnnotationError, true
	case p.Node == "":
		if p.Gated {
			return "not scheduled yet; will be enrolled and Ready only once meshed", false
		}
		return "not scheduled yet; will be enrolled, but NOT gated: Ready will not wait for the mesh", true
	case noAgent && p.Gated:
		return fmt.Sprintf("NOT MESHED: no agent on node %s; the gate keeps it NotReady (fail closed)", p.Node), true
	case noAgent:
		return fmt.Sprintf("NOT MESHED: no agent on node %s, and no gate: it may be Ready without the mesh", p.Node), true
	case p.Redirection == podmeta.RedirectionEnabled && c != nil && c.Status == string(corev1.ConditionTrue):
		if !p.Gated {
			return "meshed (enabled); no gate: Ready did not wait for the mesh", false
		}
		return "meshed (enabled)", false
	case p.Redirection == podmeta.RedirectionEnabled && c != nil && c.Status == string(corev1.ConditionFalse) && c.Reason == "ZtunnelUnavailable":
		// The agent's Unserved phase: captured, and no ztunnel serves the node.
		if p.Gated {
			return fmt.Sprintf("NOT SERVED: no ztunnel serves node %s (its traffic is captured and refused); NotReady until one acks its snapshot", p.Node), true
		}
		return fmt.Sprintf("NOT SERVED: no ztunnel serves node %s (its traffic is captured and refused); NOT gated: it may be Ready", p.Node), true
	case c != nil && c.Status == string(corev1.ConditionFalse) && c.Reason == "RuntimeNotCapturable":
		// A sandboxed runtime (gVisor, Kata): the agent refuses it, so
		// it does not run as a mesh pod its traffic would bypass.
		return "NOT MESHED: its runtime handler's traffic cannot be captured, the agent refuses it (" + c.Message + ")", true
	case p.Redirection == podmeta.RedirectionPending || (c != nil && c.Status == string(corev1.ConditionFalse)):
		msg := "pending"
		if c != nil {
			msg += ": " + c.Reason
			if c.Message != "" {
				msg += " (" + c.Message + ")"
			}
		}
		if p.Gated {
			return msg + "; NotReady until ztunnel takes it", true
		}
		return msg + "; NOT gated: it may be Ready while its traffic is held", true
	default:
		return "not enrolled yet (the agent has not handled its sandbox)", !p.Gated
	}
}
