//go:build e2e

package e2e

// End-to-end tests of "Ready means meshed when ztunnel is gone": with the
// real bin/ambientd on its default flags, the real CNI chain and
// bin/ztunnel-emulator in netns mode, enrolled pods turn False /
// ZtunnelUnavailable once no ztunnel has served the node for the grace, and
// True again as soon as a new ztunnel acked its snapshot; a rolling ztunnel
// upgrade whose new instance connects before the old one leaves never turns
// a pod False.

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// ztunnelGrace is the agent's default grace (--ztunnel-grace).
var ztunnelGrace = agent.DefaultConfig().ZtunnelGrace

// firstVersion returns the first version of the pod the watch delivered
// after since that satisfies cond.
func (pw *podWatch) firstVersion(name string, since time.Time, cond func(*corev1.Pod) bool) (seenPod, bool) {
	for _, s := range pw.of(name) {
		if !s.at.Before(since) && cond(s.pod) {
			return s, true
		}
	}
	return seenPod{}, false
}

// snapshotAckedAt is when the emulator received the SnapshotSent of its
// newest connection (it acks it at once), or zero.
func snapshotAckedAt(st ztunnelemu.State) time.Time {
	if len(st.Connections) == 0 {
		return time.Time{}
	}
	id := st.Connections[len(st.Connections)-1].ID
	for _, r := range st.RequestsOn(id) {
		if r.Op == "snapshot_sent" {
			return r.At
		}
	}
	return time.Time{}
}

func snapshotSent(s ztunnelemu.State) bool {
	return len(s.Connections) > 0 && s.Connections[len(s.Connections)-1].SnapshotSent && s.Connected
}

// TestZtunnelGoneTurnsPodsNotReady (Must show 1): three enrolled pods (one
// gated); the only ztunnel is killed. No pod turns False before the grace;
// all turn False/ZtunnelUnavailable within grace + 2 s with the annotation
// still `enabled`; the node gets a Warning Event and the metric counts them.
// A new ztunnel that refuses one of them connects: the others are True
// within 1 s of its snapshot ack and their traffic is captured again; the
// refused one stays False/ZtunnelRejected.
func TestZtunnelGoneTurnsPodsNotReady(t *testing.T) {
	s := newScenario(t, "ztgone")
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	pw := watchPods(t, ctx, nsName)
	var pods []*e2eenv.Pod
	for i, name := range []string{"gated", "plain", "refused"} {
		spec := e2eenv.PodSpec{Namespace: nsName, Name: name}
		if i == 0 {
			spec.Mutate = gated
		}
		pods = append(pods, createPod(t, ctx, spec))
	}
	for _, p := range pods {
		waitPod(t, ctx, p, "True/Enrolled", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
	}

	left := time.Now()
	if err := em.Kill(); err != nil {
		t.Fatalf("kill emulator: %v", err)
	}
	notReady := podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelUnavailable)
	// Bounded well past the grace (the timing is checked below, from the
	// watch), so that a pod that stays True fails in seconds.
	wctx, cancel := context.WithTimeout(ctx, ztunnelGrace+30*time.Second)
	defer cancel()
	for _, p := range pods {
		o := waitPod(t, wctx, p, "False/ZtunnelUnavailable", notReady)
		if v := o.Annotations[annRedirect]; v != "enabled" {
			t.Errorf("%s: annotation %q while ztunnel is gone, want enabled (the rules stay)", p.Name, v)
		}
		if p == pods[0] && kubeletWouldBeReady(o) {
			t.Errorf("gated pod would be Ready with no ztunnel: %+v", o.Status.Conditions)
		}
	}
	for _, p := range pods {
		s, ok := pw.firstVersion(p.Name, left, func(o *corev1.Pod) bool {
			c := enrolledCondition(o)
			return c != nil && c.Status != corev1.ConditionTrue
		})
		if !ok {
			t.Fatalf("%s: the watch never delivered the False condition", p.Name)
		}
		took := s.at.Sub(left)
		t.Logf("%s: False %v after the last ztunnel was killed (grace %v)", p.Name, took.Round(time.Millisecond), ztunnelGrace)
		if took < ztunnelGrace {
			t.Errorf("%s: False %v after ztunnel left, before the grace %v", p.Name, took, ztunnelGrace)
		}
		if took > ztunnelGrace+2*time.Second {
			t.Errorf("%s: False %v after ztunnel left, want within grace %v + 2s", p.Name, took, ztunnelGrace)
		}
	}
	ev := waitNodeEventSince(t, ctx, testEnv.NodeName, agent.EventZtunnelUnavailable, left)
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, "3 pods") {
		t.Errorf("node Event %s %s %q: want a Warning counting the 3 pods", ev.Type, ev.Reason, ev.Message)
	}
	// kubectl describe node selects the node's Events by name and by a uid
	// equal to the name (as kubelet records them).
	if ev.InvolvedObject.UID != types.UID(testEnv.NodeName) {
		t.Errorf("node Event about uid %q: kubectl describe node %s would not show it", ev.InvolvedObject.UID, testEnv.NodeName)
	}
	testutil.Until(t, ctx, "metric of pods not ready by reason", func() bool {
		return metricValue(t, ctx, a, "ambientd_pods_not_ready", `reason="ZtunnelUnavailable"`) == 3
	})

	em2, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: "ztunnel-gone-2",
		Args: []string{"--nack=" + nsName + "/refused=refused by the new ztunnel"}})
	if err != nil {
		t.Fatalf("start second emulator: %v", err)
	}
	em2.LogOnFailure(t)
	t.Cleanup(func() { em2.Stop(10 * time.Second) })
	st := waitEmu(t, ctx, em2, "the new ztunnel's snapshot", snapshotSent)
	acked := snapshotAckedAt(st)
	for _, p := range pods[:2] {
		waitPod(t, ctx, p, "True/Enrolled again", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
		s, ok := pw.firstVersion(p.Name, left, podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
		if !ok {
			t.Fatalf("%s: the watch never delivered True again", p.Name)
		}
		took := s.at.Sub(acked)
		t.Logf("%s: True %v after the new ztunnel's snapshot ack", p.Name, took.Round(time.Millisecond))
		if took > time.Second {
			t.Errorf("%s: True %v after the snapshot ack, want within 1s", p.Name, took)
		}
		requireCaptured(t, ctx, em2, p, outsideAddr())
	}
	refused := pods[2]
	waitPod(t, ctx, refused, "False/ZtunnelRejected", podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelRejected))
	if s, ok := pw.firstVersion(refused.Name, left, podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled)); ok {
		t.Errorf("refused pod was True again at resourceVersion %s", s.pod.ResourceVersion)
	}
	waitNodeEventSince(t, ctx, testEnv.NodeName, agent.EventZtunnelAvailable, left)
	checkTogether(t, append(append(pw.of("gated"), pw.of("plain")...), pw.of("refused")...))
}

// TestZtunnelOverlapNeverNotReady (Must show 2): ztunnel upgraded three
// times the way a DaemonSet with maxSurge does it — the new one connects and
// acks its snapshot, then the old one leaves — with the strictest grace
// (1ms, through its env var): not one version of any pod is False, and the
// pods' traffic is captured by the newest ztunnel after each step.
func TestZtunnelOverlapNeverNotReady(t *testing.T) {
	s := newScenario(t, "ztsurge", agentEnv("AMBIENTD_ZTUNNEL_GRACE=1ms"))
	ctx, nsName, old := s.ctx, s.ns, s.em
	pw := watchPods(t, ctx, nsName)
	var pods []*e2eenv.Pod
	for _, name := range []string{"a", "b", "c"} {
		pods = append(pods, createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: name, Mutate: gated}))
	}
	for _, p := range pods {
		waitPod(t, ctx, p, "True/Enrolled", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
	}
	start := time.Now()
	for round := 1; round <= 3; round++ {
		next, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: fmt.Sprintf("ztunnel-surge-%d", round)})
		if err != nil {
			t.Fatalf("round %d: start the new ztunnel: %v", round, err)
		}
		next.LogOnFailure(t)
		t.Cleanup(func() { next.Stop(10 * time.Second) })
		waitEmu(t, ctx, next, "the new ztunnel's snapshot", snapshotSent)
		if err := old.Stop(10 * time.Second); err != nil {
			t.Fatalf("round %d: stop the old ztunnel: %v", round, err)
		}
		for _, p := range pods {
			requireCaptured(t, ctx, next, p, outsideAddr())
		}
		old = next
	}
	// The end point: a real outage after the upgrades. Each pod's first
	// version that is not True must come after it — not one during the
	// upgrades, however short the grace.
	gone := time.Now()
	if err := old.Kill(); err != nil {
		t.Fatalf("kill the last ztunnel: %v", err)
	}
	wctx, cancel := context.WithTimeout(ctx, ztunnelGrace+30*time.Second)
	defer cancel()
	for _, p := range pods {
		waitPod(t, wctx, p, "False/ZtunnelUnavailable after the last ztunnel left", podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelUnavailable))
		vs := pw.of(p.Name)
		for _, s := range vs {
			if c := enrolledCondition(s.pod); s.at.After(start) && s.at.Before(gone) && (c == nil || c.Status != corev1.ConditionTrue) {
				t.Errorf("%s: resourceVersion %s during the upgrades has condition %+v, want True throughout", p.Name, s.pod.ResourceVersion, c)
			}
		}
		t.Logf("%s: %d versions watched, True throughout the 3 upgrades", p.Name, len(vs))
	}
}

// TestHungZtunnelTurnsPodsNotReady: a ztunnel that hangs with its socket
// open (a deadlock, a full queue) looks to the kernel like a healthy idle
// one — ZDS has no heartbeat. The agent's idle probe (a Del of a uid no
// pod has) goes unanswered: the connection is dropped, and after the grace
// the enrolled pods turn False/ZtunnelNotResponding (annotation still
// `enabled`), the node condition says ZtunnelNotResponding, the node gets
// a ZtunnelNotResponding Event and the metric counts the hung connection.
// A healthy ztunnel replacing it (the hung one killed, a new one started)
// makes them True again, their traffic captured by it.
func TestHungZtunnelTurnsPodsNotReady(t *testing.T) {
	s := newScenario(t, "zthung", agentEnv("AMBIENTD_ZTUNNEL_PROBE_INTERVAL=1s", "AMBIENTD_NODE_CONDITION_SETTLE=0"))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web", Mutate: gated})
	waitPod(t, ctx, p, "True/Enrolled", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))

	hung := time.Now()
	if err := em.Hang(ctx); err != nil {
		t.Fatalf("hang the emulator: %v", err)
	}
	// Probe 1s + ack timeout 5s + grace, with room for a loaded machine.
	wctx, cancel := context.WithTimeout(ctx, ztunnelGrace+40*time.Second)
	defer cancel()
	o := waitPod(t, wctx, p, "False/ZtunnelNotResponding", podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelNotResponding))
	t.Logf("pod False/ZtunnelNotResponding %v after ztunnel hung", time.Since(hung).Round(time.Millisecond))
	if v := o.Annotations[annRedirect]; v != "enabled" {
		t.Errorf("annotation %q while ztunnel hangs, want enabled (the rules stay)", v)
	}
	if kubeletWouldBeReady(o) {
		t.Errorf("gated pod would be Ready with a hung ztunnel: %+v", o.Status.Conditions)
	}
	waitNode(t, ctx, testEnv.NodeName, "node condition False/ZtunnelNotResponding", conditionIs(corev1.ConditionFalse, nodeready.ReasonZtunnelNotResponding))
	waitNodeEventSince(t, ctx, testEnv.NodeName, agent.EventZtunnelNotResponding, hung)
	if v := metricValue(t, ctx, a, "ambientd_ztunnel_unresponsive_total", ""); v < 1 {
		t.Errorf("ambientd_ztunnel_unresponsive_total = %v after a hung ztunnel", v)
	}

	// Restarted (a liveness failure, an operator): the hung process goes —
	// with its listeners in the pods' netns — and a healthy one comes.
	if err := em.Kill(); err != nil {
		t.Fatalf("kill the hung emulator: %v", err)
	}
	em2, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: "ztunnel-hung-2"})
	if err != nil {
		t.Fatalf("start the replacing emulator: %v", err)
	}
	em2.LogOnFailure(t)
	t.Cleanup(func() { em2.Stop(10 * time.Second) })
	waitEmu(t, ctx, em2, "the new ztunnel's snapshot", snapshotSent)
	waitPod(t, ctx, p, "True/Enrolled again", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
	requireCaptured(t, ctx, em2, p, outsideAddr())
	waitNode(t, ctx, testEnv.NodeName, "node condition True", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))
}
