package agent

import (
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

func TestStatusFor(t *testing.T) {
	tests := []struct {
		name       string
		e          registry.Entry
		inMesh     bool
		wantOK     bool
		wantAnn    string
		wantStatus corev1.ConditionStatus
		wantReason string
	}{
		{name: "enabled", e: registry.Entry{Phase: registry.Enabled}, inMesh: true, wantOK: true, wantAnn: podmeta.RedirectionEnabled, wantStatus: corev1.ConditionTrue, wantReason: ReasonEnrolled},
		{name: "pending unclassified", e: registry.Entry{Phase: registry.Pending}, inMesh: true, wantOK: true, wantAnn: podmeta.RedirectionPending, wantStatus: corev1.ConditionFalse, wantReason: ReasonPending},
		{name: "pending no ztunnel", e: registry.Entry{Phase: registry.Pending, Reason: ReasonZtunnelUnavailable, LastError: "no ztunnel"}, inMesh: true, wantOK: true, wantAnn: podmeta.RedirectionPending, wantStatus: corev1.ConditionFalse, wantReason: ReasonZtunnelUnavailable},
		{name: "uncaptured, sandbox changed", e: registry.Entry{Phase: registry.Uncaptured, Reason: ReasonSandboxChanged, LastError: "sandbox gone (CNI DEL)"}, inMesh: true, wantOK: true, wantAnn: podmeta.RedirectionPending, wantStatus: corev1.ConditionFalse, wantReason: ReasonSandboxChanged},
		{name: "uncaptured unclassified", e: registry.Entry{Phase: registry.Uncaptured}, inMesh: true, wantOK: true, wantAnn: podmeta.RedirectionPending, wantStatus: corev1.ConditionFalse, wantReason: ReasonRulesFailed},
		{name: "left the mesh", e: registry.Entry{Phase: registry.Absent}, wantOK: true, wantStatus: corev1.ConditionTrue, wantReason: ReasonNotInMesh},
		{name: "let go while in mesh", e: registry.Entry{Phase: registry.Absent}, inMesh: true, wantOK: true, wantStatus: corev1.ConditionFalse, wantReason: ReasonNotEnrolled},
		{name: "gone", e: registry.Entry{Phase: registry.Absent, Gone: true}},
		{name: "unverified keeps", e: registry.Entry{Phase: registry.Unverified}, inMesh: true},
		{name: "releasing keeps", e: registry.Entry{Phase: registry.Releasing}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st, ok := statusFor(tt.e, tt.inMesh)
			if ok != tt.wantOK {
				t.Fatalf("ok = %v, want %v", ok, tt.wantOK)
			}
			if !ok {
				return
			}
			if st.Redirection != tt.wantAnn || st.Condition.Status != tt.wantStatus || st.Condition.Reason != tt.wantReason || st.Condition.Message == "" {
				t.Errorf("status %+v, want annotation %q, condition %s/%s with a message", st, tt.wantAnn, tt.wantStatus, tt.wantReason)
			}
		})
	}
	if got := pendingReason("ztunnel_nack"); got != ReasonZtunnelRejected {
		t.Errorf("pendingReason(ztunnel_nack) = %q", got)
	}
	if got := pendingReason("probe_ips"); got != ReasonRulesFailed {
		t.Errorf("pendingReason(probe_ips) = %q", got)
	}
}

// TestPodConditionFollowsPhase: the condition is written with the
// annotation, False with the reason while pending (and a pending Event),
// True when enabled, True/NotInMesh when the pod leaves the mesh.
func TestPodConditionFollowsPhase(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	if out, err := h.cni.HandleAdd(t.Context(), h.event(p)); err != nil || out != Pending {
		t.Fatalf("HandleAdd = %v, %v; want Pending", out, err)
	}
	h.waitFor("condition False/ZtunnelUnavailable with annotation pending", func() bool {
		c := h.condition("app", "a")
		v, _ := h.annotation("app", "a")
		return c != nil && c.Status == corev1.ConditionFalse && c.Reason == ReasonZtunnelUnavailable && c.Message != "" && v == "pending"
	})
	h.waitFor("pending Event", func() bool { return h.hasEvent("app", EventPending, ReasonZtunnelUnavailable) })
	h.zt.connect()
	h.waitFor("condition True/Enrolled with annotation enabled", func() bool {
		c := h.condition("app", "a")
		v, _ := h.annotation("app", "a")
		return c != nil && c.Status == corev1.ConditionTrue && c.Reason == ReasonEnrolled && v == "enabled"
	})
	h.setNamespace("app", false)
	h.waitFor("condition True/NotInMesh without annotation", func() bool {
		c := h.condition("app", "a")
		_, has := h.annotation("app", "a")
		return c != nil && c.Status == corev1.ConditionTrue && c.Reason == ReasonNotInMesh && !has
	})
}

func TestRemovalFailedEvent(t *testing.T) {
	p := runningPod(pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "10.1.0.5")
	h := newHarness(t, withObjects(namespace("app", true), p)) // empty host proc: the netns is never found
	h.zt.connect()
	h.setNamespace("app", false)
	h.waitFor("RemovalFailed Event", func() bool { return h.hasEvent("app", EventRemovalFailed, "") })
}

func TestEnrollmentFailedEvent(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.rules.mu.Lock()
	h.rules.applyErr = errors.New("iptables-restore: broken")
	h.rules.mu.Unlock()
	if _, err := h.cni.HandleAdd(t.Context(), h.event(p)); !errors.Is(err, ErrNotCaptured) {
		t.Fatalf("HandleAdd error %v, want ErrNotCaptured", err)
	}
	h.waitFor("EnrollmentFailed Event", func() bool { return h.hasEvent("app", EventEnrollmentFailed, "iptables-restore: broken") })
}
