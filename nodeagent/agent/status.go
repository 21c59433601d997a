package agent

import (
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// Pod condition reasons (docs/readiness.md). The condition is True only
// when ztunnel carries the pod (Enrolled) or the agent took the pod out of
// the mesh on purpose (NotInMesh: a pod gated on the condition that leaves
// the mesh must not stay NotReady for ever); False otherwise.
const (
	ReasonEnrolled  = "Enrolled"  // True: ztunnel acked the pod, probe IPs set
	ReasonNotInMesh = "NotInMesh" // True: removed from the mesh (label/namespace/policy)
	// True: the node was handed over to another node agent (Istio's
	// istio-cni, --handover), which keeps no such condition: a gated pod
	// left False would be NotReady for ever.
	ReasonHandedOver = "HandedOver"
	// False: the node was handed over, but the pod's rules could not be
	// moved to the successor's backend: its capture is not known.
	ReasonNotHandedOver = "NotHandedOver"
	// True: ambientd was uninstalled from the node with no successor
	// (--handover none): the pod, False then, had its rules removed and
	// runs outside the mesh; nothing will write the condition again.
	ReasonUninstalled = "Uninstalled"
	// False: as Uninstalled, but the pod's rules could not be removed (or
	// its network namespace was never found): its capture is not known.
	ReasonNotReleased = "NotReleased"
	// False: rules in place, ztunnel has not acked the pod yet (an ack
	// timeout, a restart that has not verified the pod yet).
	ReasonPending = "Pending"
	// False: no ztunnel connected when the pod was to be added, or (the
	// annotation staying `enabled`) no ztunnel served the node for the
	// grace after it had the pod (registry.Unserved).
	ReasonZtunnelUnavailable = "ZtunnelUnavailable"
	ReasonZtunnelRejected    = "ZtunnelRejected" // False: ztunnel refused the pod (nack, snapshot refusal)
	// False (the annotation staying `enabled`): the node's ztunnel stopped
	// answering (hung with its socket open) and none served for the grace.
	ReasonZtunnelNotResponding = "ZtunnelNotResponding"
	ReasonRulesFailed          = "RulesFailed" // False: the pod's rules or its probe entry could not be put in place
	// False: the pod's sandbox changed or went (recreated, a DEL of a pod
	// that still exists, an IP change): not captured until the agent has
	// enrolled it in its new sandbox.
	ReasonSandboxChanged = "SandboxChanged"
	// False: after a restart the pod's network namespace was not found
	// (or not proven to be its sandbox); searched again with backoff.
	ReasonNetnsNotFound = "NetnsNotFound"
	// False: the pod belongs in the mesh but the agent let go of it
	// (--fail-pending rolled it back; its Events say why).
	ReasonNotEnrolled = "NotEnrolled"
	// False: the pod belongs in the mesh but runs under a runtime handler
	// (gVisor, Kata, ...) whose traffic the in-pod rules do not capture
	// (policy.CheckRuntime); never enrolled, never annotated.
	ReasonRuntimeNotCapturable = "RuntimeNotCapturable"
)

// pendingReason maps activate's failure kinds (its metric labels) to
// condition reasons.
func pendingReason(kind string) string {
	switch kind {
	case "no_ztunnel":
		return ReasonZtunnelUnavailable
	case "ztunnel_nack":
		return ReasonZtunnelRejected
	case "probe_ips":
		return ReasonRulesFailed
	}
	return ReasonPending
}

// statusFor derives what a pod in entry e's phase shows the cluster; ok is
// false when the phase has no say (Unverified and Releasing keep whatever the
// pod shows; a pod that is gone has nothing to show). This is the one place
// the status is derived: the annotation and the pod condition (with
// e.LastError as its message) together. inMesh is the policy's verdict on
// the pod, which only matters for a pod the agent does not hold.
func statusFor(e registry.Entry, inMesh bool) (st podstatus.Status, ok bool) {
	switch e.Phase {
	case registry.Enabled:
		return podstatus.Status{Redirection: podmeta.RedirectionEnabled, Condition: podstatus.Condition{
			Status: corev1.ConditionTrue, Reason: ReasonEnrolled, Message: "ztunnel carries the pod's traffic",
		}}, true
	case registry.Pending:
		return notCarried(e, ReasonPending, "traffic captured, waiting for ztunnel to take the pod"), true
	case registry.Unserved:
		// Still `enabled` (the rules are in place and ztunnel had the
		// pod; istiod keeps it HBONE-capable, which it is again the
		// moment a ztunnel serves), but not ready: nothing proxies it.
		st := notCarried(e, ReasonZtunnelUnavailable, "no ztunnel serves the node: the pod's traffic is captured with no proxy behind it")
		st.Redirection = podmeta.RedirectionEnabled
		return st, true
	case registry.Uncaptured:
		// The annotation Istio knows for "not carried yet" (istiod treats
		// only enabled as HBONE-capable); the condition says why.
		return notCarried(e, ReasonRulesFailed, "the pod's current sandbox is not known to be captured; the agent retries"), true
	case registry.Absent:
		if inMesh {
			return podstatus.Status{Condition: podstatus.Condition{
				Status: corev1.ConditionFalse, Reason: ReasonNotEnrolled, Message: "the pod belongs in the ambient mesh but is not enrolled; see its Events",
			}}, !e.Gone
		}
		return podstatus.Status{Condition: podstatus.Condition{
			Status: corev1.ConditionTrue, Reason: ReasonNotInMesh, Message: "the pod is not in the ambient mesh",
		}}, !e.Gone
	}
	return podstatus.Status{}, false
}

// handedOver is what a pod showing cur is left with when the node is
// handed over to another node agent: a False condition turns True/HandedOver
// (the annotation kept); ok is false when nothing changes.
func handedOver(cur podstatus.Status) (podstatus.Status, bool) {
	if cur.Condition.Status != corev1.ConditionFalse {
		return podstatus.Status{}, false
	}
	return podstatus.Status{Redirection: cur.Redirection, Condition: podstatus.Condition{
		Status: corev1.ConditionTrue, Reason: ReasonHandedOver, Since: time.Now(),
		Message: "the node was handed over to another mesh agent (--handover), which does not keep this condition; it was False: " + cur.Condition.Message,
	}}, true
}

// notHandedOver is what a pod showing a False condition is left with when
// the node is handed over but the pod's rules were not moved into the
// successor's backend (the move failed, or its network namespace was never
// found): False with a reason that says so — its capture is not known.
func notHandedOver(cur podstatus.Status) (podstatus.Status, bool) {
	if cur.Condition.Status != corev1.ConditionFalse {
		return podstatus.Status{}, false
	}
	return podstatus.Status{Redirection: cur.Redirection, Condition: podstatus.Condition{
		Status: corev1.ConditionFalse, Reason: ReasonNotHandedOver, Since: cur.Condition.Since,
		Message: "the node was handed over to another mesh agent (--handover), but this pod's rules could not be moved to it: its traffic may not be captured; it was False: " + cur.Condition.Message,
	}}, true
}

// notCarried is the status of a pod ztunnel does not carry: pending, the
// condition False with e's reason and error, or these defaults.
func notCarried(e registry.Entry, reason, message string) podstatus.Status {
	c := podstatus.Condition{Status: corev1.ConditionFalse, Reason: e.Reason, Message: e.LastError}
	if c.Reason == "" {
		c.Reason = reason
	}
	if c.Message == "" {
		c.Message = message
	}
	return podstatus.Status{Redirection: podmeta.RedirectionPending, Condition: c}
}

// shows returns what pod shows now, in statusFor's terms: has is true when
// the pod carries the annotation or the condition.
func (a *Agent) shows(pod *corev1.Pod) (st podstatus.Status, has bool) {
	v, hasAnn := pod.Annotations[podmeta.AnnotationRedirection]
	st.Redirection = v
	c := podCondition(pod, a.cfg.PodConditionType)
	if c != nil {
		st.Condition = podstatus.Condition{Status: c.Status, Reason: c.Reason, Message: c.Message, Since: c.LastTransitionTime.Time}
	}
	return st, hasAnn || c != nil
}

func podCondition(pod *corev1.Pod, t string) *corev1.PodCondition {
	for i := range pod.Status.Conditions {
		if string(pod.Status.Conditions[i].Type) == t {
			return &pod.Status.Conditions[i]
		}
	}
	return nil
}

// publish queues the status write a sync calls for: after a phase move
// always; otherwise only to heal a pod that shows something else than its
// phase says (a write lost during an API outage, a hand edit, a ztunnel that
// refused the pod). A pod the agent does not hold is only cleaned when it is
// out of the mesh and not finished (a terminal pod's network is gone), or
// given True/NotInMesh when it is gated on the condition and shows none
// (awaitsCondition).
//
// It is also where the pod's Events come from (the sync's error err says
// what failed), so the Events follow the same phase moves as the status.
func (a *Agent) publish(s podSync, after registry.Entry, moved bool, err error) {
	pod := s.pod
	if pod == nil {
		return
	}
	if s.uncapturable != nil && after.Phase == registry.Absent {
		a.publishUncapturable(s)
		return
	}
	a.eventFor(s, after, moved, err)
	a.reportMissingGate(s, after, moved)
	if s.undecided && after.Phase == registry.Absent {
		// Not known to be out of the mesh: True/NotInMesh could make a
		// pod that belongs in it Ready uncaptured. Its retry decides.
		return
	}
	want, ok := statusFor(after, s.inMesh)
	if !ok {
		return
	}
	cur, has := a.shows(pod)
	switch {
	case !moved && a.status.LandedAfter(string(pod.UID), pod.ResourceVersion, want):
		// The pod was read before our own write of want landed (the
		// watch cache lags it): nothing to heal.
		return
	case moved:
	case after.Phase == registry.Absent:
		terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
		if s.inMesh || terminal || (!has && !a.awaitsCondition(pod)) || cur.Equal(want) {
			return
		}
	case has && cur.Equal(want):
		return
	}
	// lastTransitionTime moves only when the condition's status does.
	want.Condition.Since = time.Now()
	if cur.Condition.Status == want.Condition.Status && !cur.Condition.Since.IsZero() {
		want.Condition.Since = cur.Condition.Since
	}
	// Only the write of the move itself: a sync that only heals what a
	// stale cache still shows as pending is not the pod's first moment.
	want.FirstTrue = moved && firstTrue(cur, want)
	a.status.Set(pod.Namespace, pod.Name, string(pod.UID), want)
}

// firstTrue reports whether writing want over what the pod shows (cur)
// makes its condition True/Enrolled for the first time: the pod shows no
// True condition and was never enabled (an enabled pod whose ztunnel went
// away, Unserved, keeps its annotation). ambientd_pod_mesh_ready_seconds
// observes these writes.
func firstTrue(cur, want podstatus.Status) bool {
	return want.Condition.Status == corev1.ConditionTrue && want.Condition.Reason == ReasonEnrolled &&
		cur.Condition.Status != corev1.ConditionTrue && cur.Redirection != podmeta.RedirectionEnabled
}

// publishNow writes the status of e's phase at once, in the middle of a sync
// (which publishes again at its end if the phase moves on).
func (a *Agent) publishNow(s *podSync, e registry.Entry) {
	if s == nil || s.pod == nil || !a.takeMoved(e.UID) {
		return
	}
	a.publish(*s, e, true, nil)
}

// publishMoved publishes pod uid's status now if its phase moved (outside a
// sync: the drift pass, a restart's verification).
func (a *Agent) publishMoved(uid string) {
	pod := a.podByUID(uid)
	if pod == nil {
		return
	}
	e, _ := a.reg.Get(uid)
	s := podSync{pod: pod, inMesh: true}
	a.publishNow(&s, e)
}
