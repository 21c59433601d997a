//go:build e2e

package e2e

// End-to-end tests of "Ready means meshed" with the real
// bin/ambientd (the agent's RBAC token throughout), the real CNI chain and
// bin/ztunnel-emulator: the pod condition ambient.istio.io/enrolled, pod
// Events, and the node condition and startup taint wired into the daemon.
//
// No kubelet runs here, so nobody computes a pod's Ready condition from its
// readiness gates. The tests assert the values kubelet uses for that (every
// condition named in spec.readinessGates True, plus ContainersReady — see
// kubeletWouldBeReady), which is what "not stuck NotReady" means.

import (
	"context"
	"fmt"
	"github.com/ambientd/ambientd/podmeta"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

const podCondition = podmeta.ConditionEnrolled

func enrolledCondition(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == podCondition {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

func podConditionIs(status corev1.ConditionStatus, reason string) func(*corev1.Pod) bool {
	return func(p *corev1.Pod) bool {
		c := enrolledCondition(p)
		return c != nil && c.Status == status && c.Reason == reason
	}
}

// kubeletWouldBeReady is kubelet's rule for the Ready condition of a pod
// with readiness gates: containers ready and every gate's condition True
// (a gate whose condition is missing counts as False).
func kubeletWouldBeReady(p *corev1.Pod) bool {
	cond := func(t corev1.PodConditionType) bool {
		i := slices.IndexFunc(p.Status.Conditions, func(c corev1.PodCondition) bool { return c.Type == t })
		return i >= 0 && p.Status.Conditions[i].Status == corev1.ConditionTrue
	}
	if !cond(corev1.ContainersReady) {
		return false
	}
	for _, g := range p.Spec.ReadinessGates {
		if !cond(g.ConditionType) {
			return false
		}
	}
	return true
}

func waitPod(t *testing.T, ctx context.Context, p *e2eenv.Pod, what string, cond func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	o, err := testEnv.WaitForPod(ctx, p.Namespace, p.Name, func(o *corev1.Pod) (bool, error) { return cond(o), nil })
	if err != nil {
		t.Fatalf("pod %s/%s: waiting for %s: %v (conditions %+v)", p.Namespace, p.Name, what, err, conditionsOf(o))
	}
	return o
}

func conditionsOf(p *corev1.Pod) []corev1.PodCondition {
	if p == nil {
		return nil
	}
	return p.Status.Conditions
}

// podWatch records every version of the namespace's pods the API server
// sends, with the time it arrived.
type podWatch struct {
	mu   sync.Mutex
	seen []seenPod
}

type seenPod struct {
	at  time.Time
	pod *corev1.Pod
}

func watchPods(t *testing.T, ctx context.Context, namespace string) *podWatch {
	t.Helper()
	w, err := testEnv.CP.Admin.CoreV1().Pods(namespace).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pw := &podWatch{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			if p, ok := ev.Object.(*corev1.Pod); ok && ev.Type != watch.Error {
				pw.mu.Lock()
				pw.seen = append(pw.seen, seenPod{time.Now(), p})
				pw.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { w.Stop(); <-done })
	return pw
}

func (pw *podWatch) of(name string) []seenPod {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	var out []seenPod
	for _, s := range pw.seen {
		if s.pod.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// checkTogether fails if any version of the pod shows the annotation
// without the matching condition or the other way round: both come in one
// write. `enabled` goes with True, or with False/ZtunnelUnavailable when no
// ztunnel served the node for the grace (the rules stay in place).
func checkTogether(t *testing.T, versions []seenPod) {
	t.Helper()
	want := map[string]corev1.ConditionStatus{"pending": corev1.ConditionFalse, "enabled": corev1.ConditionTrue}
	for _, s := range versions {
		ann, hasAnn := s.pod.Annotations[annRedirect]
		c := enrolledCondition(s.pod)
		unserved := ann == "enabled" && c != nil && c.Status == corev1.ConditionFalse && c.Reason == agent.ReasonZtunnelUnavailable
		switch {
		case hasAnn && (c == nil || c.Status != want[ann]) && !unserved:
			t.Errorf("resourceVersion %s: annotation %q with condition %+v", s.pod.ResourceVersion, ann, c)
		case !hasAnn && c != nil && c.Reason != agent.ReasonNotInMesh:
			t.Errorf("resourceVersion %s: condition %+v without the annotation", s.pod.ResourceVersion, c)
		}
	}
}

func gated(p *corev1.Pod) {
	p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: podCondition}}
}

func podEvents(t *testing.T, ctx context.Context, p *e2eenv.Pod, reason string) []corev1.Event {
	t.Helper()
	sel := fields.Set{"involvedObject.kind": "Pod", "involvedObject.uid": p.UID}.AsSelector().String()
	var out []corev1.Event
	testutil.Until(t, ctx, "Event "+reason+" on pod "+p.Name, func() bool {
		evs, err := testEnv.CP.Admin.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return false
		}
		out = out[:0]
		for _, e := range evs.Items {
			if e.Reason == reason && e.Source.Component == "ambientd" {
				out = append(out, e)
			}
		}
		return len(out) > 0
	})
	return out
}

// TestReadinessPodCondition: a pod gated on the condition is created while
// no ztunnel is connected: False/ZtunnelUnavailable with `pending` (one
// write), and a pending Event. The emulator connects: True/Enrolled with
// `enabled` in the same write, measured. A pod without the gate gets the
// condition too. Both leave the mesh (label `none`): True/NotInMesh, so
// neither is held NotReady.
func TestReadinessPodCondition(t *testing.T) {
	// A backoff far longer than the test: only the agent's reaction to the
	// ztunnel's snapshot ack can enable the pods.
	s := newScenario(t, "ready", withoutZtunnel(), agentArgs("--retry-base-delay=10m", "--retry-max-delay=10m"))
	ctx, nsName := s.ctx, s.ns
	pw := watchPods(t, ctx, nsName)

	g := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "gated", Mutate: gated})
	plain := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "plain"})
	for _, p := range []*e2eenv.Pod{g, plain} {
		o := waitPod(t, ctx, p, "condition False/ZtunnelUnavailable", podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelUnavailable))
		if o.Annotations[annRedirect] != "pending" || enrolledCondition(o).Message == "" {
			t.Errorf("%s: annotation %q, condition %+v: want pending and a message", p.Name, o.Annotations[annRedirect], enrolledCondition(o))
		}
		if p == g && kubeletWouldBeReady(o) {
			t.Errorf("gated pending pod would be Ready: %+v", o.Status.Conditions)
		}
	}
	for _, e := range podEvents(t, ctx, g, agent.EventPending) {
		t.Logf("event on pending pod: %s %s x%d: %s", e.Type, e.Reason, e.Count, e.Message)
		if e.Type != corev1.EventTypeWarning || !strings.Contains(e.Message, agent.ReasonZtunnelUnavailable) {
			t.Errorf("pending Event %s/%s %q: want a Warning naming %s", e.Type, e.Reason, e.Message, agent.ReasonZtunnelUnavailable)
		}
	}

	started := time.Now()
	em := startEmulator(t, ctx, "ztunnel-readiness")
	var acked time.Time
	waitEmu(t, ctx, em, "snapshot sent", func(s ztunnelemu.State) bool {
		if slices.ContainsFunc(s.Connections, func(c ztunnelemu.ConnRecord) bool { return c.SnapshotSent }) {
			acked = time.Now()
			return true
		}
		return false
	})
	o := waitPod(t, ctx, g, "condition True/Enrolled", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
	if o.Annotations[annRedirect] != "enabled" || !kubeletWouldBeReady(o) {
		t.Errorf("gated pod: annotation %q, would be Ready %v: want enabled and Ready", o.Annotations[annRedirect], kubeletWouldBeReady(o))
	}
	// When the True version reached the API's watchers (the watch, not the
	// 100ms polling above).
	var trueAt time.Time
	for _, s := range pw.of(g.Name) {
		if podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled)(s.pod) {
			trueAt = s.at
			break
		}
	}
	if trueAt.IsZero() {
		t.Fatal("the watch never delivered the True condition")
	}
	fromStart, fromSnapshot := trueAt.Sub(started), trueAt.Sub(acked)
	t.Logf("condition False → True: %v after the emulator was started (incl. its process start), %v after the test saw its snapshot complete (polling, may be negative)",
		fromStart.Round(time.Millisecond), fromSnapshot.Round(time.Millisecond))
	if fromStart > 5*time.Second {
		t.Errorf("condition True %v after ztunnel appeared; want about 1s (bound 5s for a loaded machine)", fromStart)
	}
	waitPod(t, ctx, plain, "plain pod condition True/Enrolled", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))

	// Leaving the mesh on purpose: no pod stays NotReady.
	for _, p := range []*e2eenv.Pod{g, plain} {
		setPodMode(t, ctx, p, "none")
		o := waitPod(t, ctx, p, "condition True/NotInMesh", podConditionIs(corev1.ConditionTrue, agent.ReasonNotInMesh))
		if _, has := o.Annotations[annRedirect]; has || !kubeletWouldBeReady(o) {
			t.Errorf("%s after leaving the mesh: annotations %v, would be Ready %v", p.Name, o.Annotations, kubeletWouldBeReady(o))
		}
	}
	for _, p := range []*e2eenv.Pod{g, plain} {
		versions := pw.of(p.Name)
		checkTogether(t, versions)
		t.Logf("%s: %d versions watched, annotation and condition always together", p.Name, len(versions))
	}
}

// setNodeTaints replaces the node's taints (admin), restoring the old ones
// when the test ends.
func setNodeTaints(t *testing.T, ctx context.Context, name string, taints ...corev1.Taint) {
	t.Helper()
	n, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	old := n.Spec.Taints
	n.Spec.Taints = taints
	if _, err := testEnv.CP.Admin.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		if n, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{}); err == nil {
			n.Spec.Taints = old
			_, _ = testEnv.CP.Admin.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		}
	})
}

var otherTaint = corev1.Taint{Key: "example.com/dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}

// TestReadinessNodeUntaint: bin/ambientd with --untaint on a tainted node
// and no ztunnel keeps the taint and sets the node condition False with
// the reason; the emulator connects: the condition turns True and the taint
// goes. Another taint on the node and another Node's taint are untouched.
func TestReadinessNodeUntaint(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	node := testEnv.NodeName
	setNodeTaints(t, ctx, node, startupTaint, otherTaint)
	other := createTestNode(t, ctx, "readiness-other", startupTaint)

	a := startAgent(t, ctx, "--untaint")
	n := waitNode(t, ctx, node, "condition False/ZtunnelNotConnected", conditionIs(corev1.ConditionFalse, nodeready.ReasonZtunnelNotConnected))
	if !hasTaintKey(n) {
		t.Fatalf("taint removed while the node condition is False: %v", n.Spec.Taints)
	}
	if err := a.WaitReady(testutil.Context(t, 2*time.Second)); err == nil {
		t.Error("/readyz ready without a ztunnel")
	}

	started := time.Now()
	startEmulator(t, ctx, "ztunnel-untaint")
	n = waitNode(t, ctx, node, "taint removed, condition True", func(n *corev1.Node) bool {
		return !hasTaintKey(n) && conditionIs(corev1.ConditionTrue, nodeready.ReasonReady)(n)
	})
	t.Logf("emulator started → condition True and taint removed: %v (incl. emulator start, polling 50ms)", time.Since(started).Round(time.Millisecond))
	if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t == otherTaint }) {
		t.Errorf("other taint on the node lost: %v", n.Spec.Taints)
	}
	if err := a.WaitReady(ctx); err != nil {
		t.Errorf("/readyz: %v", err)
	}
	o, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, other, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !hasTaintKey(o) || nodeCondition(o) != nil {
		t.Errorf("another node was written: taints %v conditions %+v", o.Spec.Taints, o.Status.Conditions)
	}
	waitNodeEventSince(t, ctx, node, nodeready.EventTaintRemoved, started)
}

// TestReadinessNodeRetaint: with --taint-when-unready and a 2s grace, the
// emulator stopping brings the taint back after the grace period; its
// return removes it again.
func TestReadinessNodeRetaint(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	const grace = 2 * time.Second
	node := testEnv.NodeName
	setNodeTaints(t, ctx, node, startupTaint)
	em := startEmulator(t, ctx, "ztunnel-retaint")
	startAgent(t, ctx, "--untaint", "--taint-when-unready", fmt.Sprintf("--taint-grace-period=%s", grace))
	waitNode(t, ctx, node, "startup taint removed", func(n *corev1.Node) bool { return !hasTaintKey(n) })

	if err := em.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	n := waitNode(t, ctx, node, "condition False/ZtunnelNotConnected", conditionIs(corev1.ConditionFalse, nodeready.ReasonZtunnelNotConnected))
	if hasTaintKey(n) {
		t.Fatalf("tainted as soon as False, before the %s grace", grace)
	}
	n = waitNode(t, ctx, node, "taint added back", hasTaintKey)
	back := time.Since(stopped)
	if back < grace {
		t.Fatalf("taint back %v after the emulator stopped; grace is %v", back, grace)
	}
	t.Logf("emulator stopped → taint back after %v (grace %v)", back.Round(time.Millisecond), grace)
	i := slices.IndexFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == taintKey })
	if n.Spec.Taints[i].Effect != corev1.TaintEffectNoSchedule {
		t.Errorf("re-added taint %+v, want NoSchedule", n.Spec.Taints[i])
	}

	restarted := time.Now()
	if err := em.Start(); err != nil {
		t.Fatal(err)
	}
	waitNode(t, ctx, node, "taint removed again", func(n *corev1.Node) bool {
		return !hasTaintKey(n) && conditionIs(corev1.ConditionTrue, nodeready.ReasonReady)(n)
	})
	t.Logf("emulator back → taint removed after %v", time.Since(restarted).Round(time.Millisecond))
	waitNodeEventSince(t, ctx, node, nodeready.EventTaintAdded, stopped)
	waitNodeEventSince(t, ctx, node, nodeready.EventTaintRemoved, restarted)
}

// waitNodeEventSince waits for an Event of the agent with reason on the
// node, last seen at or after since (the shared node has Events of earlier
// tests; Event times have second precision).
// It returns the Event.
func waitNodeEventSince(t *testing.T, ctx context.Context, node, reason string, since time.Time) corev1.Event {
	t.Helper()
	sel := fields.Set{"involvedObject.kind": "Node", "involvedObject.name": node}.AsSelector().String()
	var found corev1.Event
	testutil.Until(t, ctx, "node Event "+reason, func() bool {
		evs, err := testEnv.CP.Admin.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return false
		}
		i := slices.IndexFunc(evs.Items, func(e corev1.Event) bool {
			return e.Reason == reason && e.Source.Component == "ambientd" && !e.LastTimestamp.Time.Before(since.Truncate(time.Second))
		})
		if i >= 0 {
			found = evs.Items[i]
		}
		return i >= 0
	})
	return found
}

// TestReadinessRBACRefusals: the agent's identity (deploy/rbac.yaml, the
// token every agent in these tests runs with) is refused what it must never
// do.
func TestReadinessRBACRefusals(t *testing.T) {
	s := newScenario(t, "rbac", within(time.Minute), plainNamespace(), withoutZtunnel(), withoutAgent())
	ctx, nsName := s.ctx, s.ns
	ag := testEnv.CP.Agent
	admin := testEnv.CP.Admin
	if _, err := admin.CoreV1().ConfigMaps(nsName).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cm"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Secrets(nsName).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	merge := []byte(`{"metadata":{"labels":{"e2e":"x"}}}`)
	refused := map[string]error{}
	_, refused["get secret"] = ag.CoreV1().Secrets(nsName).Get(ctx, "s", metav1.GetOptions{})
	_, refused["patch configmap"] = ag.CoreV1().ConfigMaps(nsName).Patch(ctx, "cm", types.MergePatchType, merge, metav1.PatchOptions{})
	_, refused["patch namespace"] = ag.CoreV1().Namespaces().Patch(ctx, nsName, types.MergePatchType, merge, metav1.PatchOptions{})
	_, refused["patch serviceaccount"] = ag.CoreV1().ServiceAccounts(e2eenv.AgentNamespace).Patch(ctx, "ambientd", types.MergePatchType, merge, metav1.PatchOptions{})
	refused["delete pods"] = ag.CoreV1().Pods(nsName).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	_, refused["create pod"] = ag.CoreV1().Pods(nsName).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}}}, metav1.CreateOptions{})
	refused["delete node"] = ag.CoreV1().Nodes().Delete(ctx, testEnv.NodeName, metav1.DeleteOptions{})
	for what, err := range refused {
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s as the agent: %v, want Forbidden", what, err)
		}
	}
}

// TestReadinessPluginInConflist: with --install-cni=false, "plugin
// installed" means our entry is in the conflist the runtime uses: taking
// it out of the chain's conflist turns the node condition False with
// PluginNotInstalled and fails /readyz; putting it back turns it True.
func TestReadinessPluginInConflist(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	node := testEnv.NodeName
	startEmulator(t, ctx, "ztunnel-plugin")
	a := startAgent(t, ctx, "--node-condition-resync=200ms")
	waitNode(t, ctx, node, "condition True", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))
	if err := a.WaitReady(ctx); err != nil {
		t.Fatalf("/readyz: %v", err)
	}

	t.Cleanup(func() {
		if err := testEnv.Chain.SetAmbientPlugin(testEnv.AmbientPluginConf()); err != nil {
			t.Errorf("restore the conflist: %v", err)
		}
	})
	if err := testEnv.Chain.SetAmbientPlugin(nil); err != nil {
		t.Fatal(err)
	}
	n := waitNode(t, ctx, node, "condition False/PluginNotInstalled", conditionIs(corev1.ConditionFalse, nodeready.ReasonPluginNotInstalled))
	t.Logf("condition message: %s", nodeCondition(n).Message)
	if !strings.Contains(nodeCondition(n).Message, filepath.Base(testEnv.Chain.ConflistPath)) {
		t.Errorf("message %q does not name the conflist in use", nodeCondition(n).Message)
	}
	if err := a.WaitReady(testutil.Context(t, 2*time.Second)); err == nil || !strings.Contains(err.Error(), "CNI plugin not installed") {
		t.Errorf("/readyz with the plugin out of the conflist: %v, want a failure naming the plugin", err)
	}

	if err := testEnv.Chain.SetAmbientPlugin(testEnv.AmbientPluginConf()); err != nil {
		t.Fatal(err)
	}
	waitNode(t, ctx, node, "condition True again", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))
}
