package agent

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/nodeagent/registry"
)

// Reasons of the Events the agent records on pods (docs/readiness.md).
const (
	// EventPending (Warning): the pod moved to pending (or its current
	// sandbox is not known to be captured: netns not found, rules
	// unrepairable); the message has the pod condition's reason and
	// message.
	EventPending = "EnrollmentPending"
	// EventEnrollmentFailed (Warning): a pod that belongs in the mesh could
	// not be enrolled (rules, netns, invalid annotation, --fail-pending).
	EventEnrollmentFailed = "EnrollmentFailed"
	// EventRemovalFailed (Warning): taking a pod out of the mesh failed; it
	// stays in the mesh and is retried.
	EventRemovalFailed = "RemovalFailed"
	// EventRulesRepaired (Warning): the drift pass found the pod's
	// redirection rules changed by someone else and put them back.
	EventRulesRepaired = "RulesRepaired"
	// EventSandboxChanged (Warning): the pod's sandbox changed or went
	// (recreated without our plugin, a DEL, new IPs); the agent enrolls it
	// in the new one.
	EventSandboxChanged = "SandboxChanged"
	// EventInvalidAnnotation (Warning): an annotation the agent reads has
	// an invalid value; the message says what the agent does instead
	// (podopts.Annotations).
	EventInvalidAnnotation = "InvalidAnnotation"
	// EventRuntimeNotCapturable (Warning): a pod that belongs in the mesh
	// runs under a runtime handler whose traffic the in-pod rules do not
	// capture (gVisor, Kata, ...); it is not enrolled (its CNI ADD is
	// refused) and the message says how to opt it out.
	EventRuntimeNotCapturable = "RuntimeNotCapturable"
)

// podEvent records an Event on pod uid, found in the informer cache or the
// registry; a pod known to neither gets none.
func (a *Agent) podEvent(uid, eventType, reason, message string) {
	ref := a.podRef(uid)
	if ref == nil {
		a.log.Debug("no Event for unknown pod", "uid", uid, "reason", reason, "message", message)
		return
	}
	a.recorder.Event(ref, eventType, reason, message)
}

func (a *Agent) podRef(uid string) *corev1.ObjectReference {
	if p := a.podByUID(uid); p != nil {
		return refOf(p.Namespace, p.Name, uid)
	}
	if e, ok := a.reg.Get(uid); ok && e.Name != "" {
		return refOf(e.Namespace, e.Name, uid)
	}
	return nil
}

func refOf(namespace, name, uid string) *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: namespace, Name: name, UID: types.UID(uid)}
}

// eventFor records the Event a sync calls for (publish calls it, so Events
// follow the phase moves the status follows): a move to pending, an
// enrollment that failed, a removal that failed. Retries that change
// nothing record nothing new (and the recorder aggregates what repeats).
func (a *Agent) eventFor(s podSync, after registry.Entry, moved bool, err error) {
	if errors.Is(err, context.Canceled) {
		return // shutting down
	}
	uid := string(s.pod.UID)
	switch {
	case err != nil && s.removing:
		a.podEvent(uid, corev1.EventTypeWarning, EventRemovalFailed,
			"Taking the pod out of the ambient mesh failed; it stays in the mesh and is retried: "+err.Error())
	case err != nil && s.inMesh && after.Phase == registry.Absent:
		// Not registered, maybe not in the informer cache yet (a CNI ADD
		// looked it up directly): the sync's pod names it.
		a.recorder.Event(refOf(s.pod.Namespace, s.pod.Name, uid), corev1.EventTypeWarning, EventEnrollmentFailed,
			"Enrolling the pod in the ambient mesh failed: "+err.Error())
	case moved && after.Phase == registry.Pending:
		st, _ := statusFor(after, true)
		a.podEvent(uid, corev1.EventTypeWarning, EventPending,
			fmt.Sprintf("Traffic captured, ztunnel has not taken the pod (%s): %s", st.Condition.Reason, st.Condition.Message))
	case moved && after.Phase == registry.Uncaptured && after.Reason != ReasonSandboxChanged:
		// (a sandbox change has its own SandboxChanged Event)
		st, _ := statusFor(after, true)
		a.podEvent(uid, corev1.EventTypeWarning, EventPending,
			fmt.Sprintf("Traffic of the pod's current sandbox not known to be captured (%s): %s", st.Condition.Reason, st.Condition.Message))
	}
}
