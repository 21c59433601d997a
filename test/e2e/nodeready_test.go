//go:build e2e

package e2e

// End-to-end tests of the node readiness controller (node side):
// nodeready.Controller runs in-process with the agent's service-account
// token (so deploy/rbac.yaml authorizes every call) against the real
// kube-apiserver; its inputs are switches the test flips. Each test makes
// its own Node objects, so the shared e2e-node is left alone.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

const taintKey = nodeready.DefaultTaintKey

var startupTaint = corev1.Taint{Key: taintKey, Value: "true", Effect: corev1.TaintEffectNoSchedule}

// switches are the controller's inputs, flipped by the test.
type switches struct {
	mu          sync.Mutex
	ztConnected bool
}

func (s *switches) setZtunnel(connected bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ztConnected = connected
}

func (s *switches) inputs() nodeready.Inputs {
	return nodeready.Inputs{
		PluginInstalled: func() error { return nil },
		AgentStarted:    func() bool { return true },
		Ztunnel: func() nodeready.ZtunnelState {
			s.mu.Lock()
			defer s.mu.Unlock()
			return nodeready.ZtunnelState{Connected: s.ztConnected, SnapshotAcked: s.ztConnected}
		},
		CNIServing: func() bool { return true },
	}
}

// startNodeReady runs a controller for node with the agent's identity
// (through restCfg, default the agent's) until the test ends.
func startNodeReady(t *testing.T, ctx context.Context, cfg nodeready.Config, sw *switches, restCfg *rest.Config) *nodeready.Controller {
	t.Helper()
	if restCfg == nil {
		restCfg = testEnv.CP.AgentConfig
	}
	client, err := kube.NewForConfig(restCfg)
	if err != nil {
		t.Fatal(err)
	}
	deps := nodeReadyDeps(t, ctx, client, cfg.NodeName)
	deps.Inputs = sw.inputs()
	c, err := nodeready.New(cfg, deps)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("nodeready Run: %v", err)
		}
	})
	return c
}

// nodeReadyDeps are the controller's deps as the daemon builds them: the
// node's informer, started, and the process's Event broadcaster, sending;
// both stop when the test ends (after the controller).
func nodeReadyDeps(t *testing.T, ctx context.Context, client kube.Interface, node string) nodeready.Deps {
	t.Helper()
	informers := kube.NewInformers(client, node)
	events := kube.NewEvents(client, node)
	ictx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	informers.Start(ictx.Done())
	sent := make(chan struct{})
	go func() { events.Run(ictx); close(sent) }()
	t.Cleanup(func() {
		cancel()
		informers.Shutdown()
		<-sent
	})
	return nodeready.Deps{Client: client, Node: informers.Node, Recorder: events.Recorder(), Log: testutil.Logger(t, slog.LevelDebug)}
}

// waitNode polls the node through the admin client until cond holds.
func waitNode(t *testing.T, ctx context.Context, name, what string, cond func(*corev1.Node) bool) *corev1.Node {
	t.Helper()
	var last *corev1.Node
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = n
		return cond(n), nil
	})
	if err != nil {
		t.Fatalf("node %s: waiting for %s: %v\nlast seen: taints %v conditions %+v", name, what, err, last.Spec.Taints, last.Status.Conditions)
	}
	return last
}

func nodeCondition(n *corev1.Node) *corev1.NodeCondition {
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == nodeready.DefaultConditionType {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

func conditionIs(status corev1.ConditionStatus, reason string) func(*corev1.Node) bool {
	return func(n *corev1.Node) bool {
		c := nodeCondition(n)
		return c != nil && c.Status == status && c.Reason == reason
	}
}

func hasTaintKey(n *corev1.Node) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == taintKey })
}

var nodeCounter atomic.Int32

func createTestNode(t *testing.T, ctx context.Context, prefix string, taints ...corev1.Taint) string {
	t.Helper()
	name := fmt.Sprintf("%s-%d", prefix, nodeCounter.Add(1))
	if _, err := e2eenv.CreateNode(ctx, testEnv.CP.Admin, name, taints); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = testEnv.CP.Admin.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// raceTaints is a transport that, on the controller's first JSON patch of
// the node, first adds another taint through the admin client: the
// controller's view of the taints is then stale exactly when it writes.
type raceTaints struct {
	next    http.RoundTripper
	node    string
	fired   atomic.Bool
	err     error
	patches atomic.Int32 // JSON patches of the node sent
}

func (r *raceTaints) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodPatch && strings.HasSuffix(req.URL.Path, "/nodes/"+r.node) &&
		req.Header.Get("Content-Type") == "application/json-patch+json" {
		r.patches.Add(1)
		if r.fired.CompareAndSwap(false, true) {
			r.err = addTaint(req.Context(), r.node, corev1.Taint{Key: "example.com/raced", Effect: corev1.TaintEffectPreferNoSchedule})
		}
	}
	return r.next.RoundTrip(req)
}

func addTaint(ctx context.Context, node string, taint corev1.Taint) error {
	n, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return err
	}
	n.Spec.Taints = append(n.Spec.Taints, taint)
	_, err = testEnv.CP.Admin.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	return err
}

func TestNodeReadyUntaint(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	dedicated := corev1.Taint{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoSchedule}
	mine := createTestNode(t, ctx, "nr-mine", dedicated, startupTaint)
	other := createTestNode(t, ctx, "nr-other", startupTaint)
	otherBefore, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, other, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}

	// The agent's identity, with a transport that races a taint edit
	// against the controller's first taint patch.
	race := &raceTaints{node: mine}
	rc := rest.CopyConfig(testEnv.CP.AgentConfig)
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { race.next = rt; return race }

	sw := &switches{}
	c := startNodeReady(t, ctx, nodeready.Config{NodeName: mine, Untaint: true, ResyncPeriod: 200 * time.Millisecond}, sw, rc)

	// No ztunnel: condition False with the reason; the taint stays.
	n := waitNode(t, ctx, mine, "condition False/ZtunnelNotConnected", conditionIs(corev1.ConditionFalse, nodeready.ReasonZtunnelNotConnected))
	if !hasTaintKey(n) {
		t.Fatalf("startup taint removed while not ready: %v", n.Spec.Taints)
	}
	t.Logf("not ready: %s=%s reason %s message %q", nodeready.DefaultConditionType, nodeCondition(n).Status, nodeCondition(n).Reason, nodeCondition(n).Message)
	testutil.Until(t, ctx, "controller status False/ZtunnelNotConnected with the taint", func() bool {
		st := c.Status()
		return st.Condition == corev1.ConditionFalse && st.Reason == nodeready.ReasonZtunnelNotConnected && st.TaintPresent
	})
	// Kubelet's own Ready condition is untouched by our status patch.
	if !slices.ContainsFunc(n.Status.Conditions, func(c corev1.NodeCondition) bool {
		return c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue
	}) {
		t.Fatalf("kubelet's Ready condition lost: %+v", n.Status.Conditions)
	}

	// ztunnel connects: condition True, taint removed, within a second of Notify.
	start := time.Now()
	sw.setZtunnel(true)
	c.Notify()
	n = waitNode(t, ctx, mine, "startup taint removed", func(n *corev1.Node) bool { return !hasTaintKey(n) })
	t.Logf("ztunnel connected -> taint removed in %s", time.Since(start).Round(time.Millisecond))
	if c := nodeCondition(n); c == nil || c.Status != corev1.ConditionTrue || c.Reason != nodeready.ReasonReady {
		t.Fatalf("taint removed but condition is %+v", c)
	}
	if !race.fired.Load() || race.err != nil {
		t.Fatalf("the concurrent taint edit did not happen: fired %v err %v", race.fired.Load(), race.err)
	}
	// The first patch was refused (its test op saw stale taints) and retried.
	if got := race.patches.Load(); got < 2 {
		t.Fatalf("%d taint patches sent; the stale one should have been refused and retried", got)
	}
	t.Logf("taint patches sent: %d (the first refused by its test op)", race.patches.Load())
	// Every other taint survives: the pre-existing ones (ours, and the
	// apiserver's node.kubernetes.io/not-ready) and the concurrent one.
	if hasTaintKey(n) {
		t.Fatalf("taints = %v", n.Spec.Taints)
	}
	for _, key := range []string{"dedicated", "example.com/raced"} {
		if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key }) {
			t.Fatalf("taint %s lost: taints now %v", key, n.Spec.Taints)
		}
	}
	// The controller records the taint's absence once its patch returned,
	// which may be after the test already saw the node without it.
	testutil.Until(t, ctx, "controller status True without taint", func() bool {
		st := c.Status()
		return st.Condition == corev1.ConditionTrue && !st.TaintPresent
	})

	// The other node was never touched.
	o, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, other, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if o.ResourceVersion != otherBefore.ResourceVersion || !hasTaintKey(o) || nodeCondition(o) != nil {
		t.Fatalf("other node changed: rv %s -> %s, taints %v, conditions %+v", otherBefore.ResourceVersion, o.ResourceVersion, o.Spec.Taints, o.Status.Conditions)
	}

	// Events on the node, through the API.
	waitEvents(t, ctx, mine, nodeready.EventAmbientNotReady, nodeready.EventAmbientReady, nodeready.EventTaintRemoved)
}

func TestNodeReadyTaintWhenUnready(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	const grace = 2 * time.Second
	mine := createTestNode(t, ctx, "nr-retaint", startupTaint)
	sw := &switches{}
	sw.setZtunnel(true)
	c := startNodeReady(t, ctx, nodeready.Config{NodeName: mine, Untaint: true, TaintWhenUnready: true,
		TaintGracePeriod: grace, ResyncPeriod: 200 * time.Millisecond}, sw, nil)
	waitNode(t, ctx, mine, "startup taint removed", func(n *corev1.Node) bool { return !hasTaintKey(n) })

	// ztunnel goes away: condition False at once, the taint after the grace.
	flipped := time.Now()
	sw.setZtunnel(false)
	c.Notify()
	n := waitNode(t, ctx, mine, "condition False", conditionIs(corev1.ConditionFalse, nodeready.ReasonZtunnelNotConnected))
	if hasTaintKey(n) {
		t.Fatalf("tainted as soon as False, before the %s grace", grace)
	}
	n = waitNode(t, ctx, mine, "taint added back", hasTaintKey)
	if d := time.Since(flipped); d < grace {
		t.Fatalf("taint back %s after ztunnel went away, grace is %s", d, grace)
	}
	t.Logf("ztunnel gone -> taint back after %s (grace %s)", time.Since(flipped).Round(time.Millisecond), grace)
	if i := slices.IndexFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == taintKey }); n.Spec.Taints[i].Effect != corev1.TaintEffectNoSchedule {
		t.Fatalf("re-added taint %+v, want NoSchedule", n.Spec.Taints[i])
	}
	testutil.Until(t, ctx, "controller status False with the taint", func() bool {
		st := c.Status()
		return st.TaintPresent && st.Condition == corev1.ConditionFalse
	})

	// Back: removed again.
	sw.setZtunnel(true)
	c.Notify()
	waitNode(t, ctx, mine, "taint removed again", func(n *corev1.Node) bool { return !hasTaintKey(n) })
	waitEvents(t, ctx, mine, nodeready.EventTaintAdded, nodeready.EventTaintRemoved, nodeready.EventAmbientNotReady, nodeready.EventAmbientReady)
}

// TestNodeReadyStopNeverTaints: stopping the agent (an upgrade) writes
// nothing, even when its inputs turn unready during the shutdown (ztunnel's
// socket closes with it) and the grace period is the shortest allowed (1s).
func TestNodeReadyStopNeverTaints(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	mine := createTestNode(t, ctx, "nr-stop")
	sw := &switches{}
	sw.setZtunnel(true)
	client, err := kube.NewForConfig(testEnv.CP.AgentConfig)
	if err != nil {
		t.Fatal(err)
	}
	deps := nodeReadyDeps(t, ctx, client, mine)
	deps.Inputs = sw.inputs()
	c, err := nodeready.New(nodeready.Config{NodeName: mine, Untaint: true, TaintWhenUnready: true, TaintGracePeriod: time.Second}, deps)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	before := waitNode(t, ctx, mine, "condition True", conditionIs(corev1.ConditionTrue, nodeready.ReasonReady))
	cancel()
	sw.setZtunnel(false)
	c.Notify()
	if err := <-done; err != nil {
		t.Fatalf("Run after cancel: %v", err)
	}
	after, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, mine, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if hasTaintKey(after) || nodeCondition(after).Status != corev1.ConditionTrue {
		t.Fatalf("node written during shutdown: rv %s -> %s, taints %v, condition %+v", before.ResourceVersion, after.ResourceVersion, after.Spec.Taints, nodeCondition(after))
	}
}

// waitEvents waits until the node has Events with every reason in reasons.
func waitEvents(t *testing.T, ctx context.Context, node string, reasons ...string) {
	t.Helper()
	sel := fields.Set{"involvedObject.kind": "Node", "involvedObject.name": node}.AsSelector().String()
	var seen []string
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		evs, err := testEnv.CP.Admin.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return false, nil
		}
		seen = seen[:0]
		for _, e := range evs.Items {
			seen = append(seen, fmt.Sprintf("%s/%s: %s", e.Type, e.Reason, e.Message))
		}
		for _, r := range reasons {
			if !slices.ContainsFunc(evs.Items, func(e corev1.Event) bool { return e.Reason == r && e.Source.Component == "ambientd" }) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("node %s events: want reasons %v, have %q: %v", node, reasons, seen, errors.Unwrap(err))
	}
	for _, s := range seen {
		t.Logf("event: %s", s)
	}
}

// TestNodeReadyOwnNodePolicy: the shipped admission policy
// (deploy/admission-policy.yaml, docs/security.md) lets the agent's
// identity write the node its token names and refuses any other node, on
// top of the controller's own guarantee. The agent uses a pod-bound
// service-account token carrying the node-name claim, as kubelet projects.
func TestNodeReadyOwnNodePolicy(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	admin := testEnv.CP.Admin
	mine := createTestNode(t, ctx, "nr-pol-mine", startupTaint)
	other := createTestNode(t, ctx, "nr-pol-other", startupTaint)

	inst := installDeploy(t, ctx, "namePrefix: e2e-nr-")
	// The agent of node `mine`, with the token its pod would have.
	mineCfg := inst.token(t, ctx, mine)
	agent, err := kubernetes.NewForConfig(mineCfg)
	if err != nil {
		t.Fatal(err)
	}
	// Policies take effect asynchronously: wait until a write to the other
	// node is refused.
	probe := []byte(`{"metadata":{"annotations":{"e2e.ambientd.io/probe":"x"}}}`)
	var lastErr error
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, lastErr = agent.CoreV1().Nodes().Patch(ctx, other, types.StrategicMergePatchType, probe, metav1.PatchOptions{})
		return isDenied(lastErr), nil
	})
	if err != nil {
		t.Fatalf("policy never enforced; last write to %s: %v", other, lastErr)
	}
	t.Logf("write to another node refused: %v", lastErr)

	// The agent of `mine` works as usual under the policy...
	sw := &switches{}
	sw.setZtunnel(true)
	startNodeReady(t, ctx, nodeready.Config{NodeName: mine, Untaint: true, ResyncPeriod: 200 * time.Millisecond}, sw, mineCfg)
	waitNode(t, ctx, mine, "untainted under the policy", func(n *corev1.Node) bool {
		return !hasTaintKey(n) && conditionIs(corev1.ConditionTrue, nodeready.ReasonReady)(n)
	})
	// ...and one configured with the wrong node name cannot write it.
	wrong := startNodeReady(t, ctx, nodeready.Config{NodeName: other, Untaint: true, ResyncPeriod: 200 * time.Millisecond}, sw, mineCfg)
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		return strings.Contains(wrong.Status().LastError, "ambientd-own-node-only"), nil
	})
	if err != nil {
		t.Fatalf("a controller for another node was not refused: status %+v", wrong.Status())
	}
	o, err := admin.CoreV1().Nodes().Get(ctx, other, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !hasTaintKey(o) || nodeCondition(o) != nil {
		t.Fatalf("other node written through the policy: taints %v conditions %+v", o.Spec.Taints, o.Status.Conditions)
	}
}

// TestTaintKeyOutsideTheMeshRefused: the attack of a compromised node
// whose policy an overlay pointed at a taint that is not the mesh's
// (`dedicated`): its agent identity tries to remove that taint from its own
// node, to attract workloads that were kept away. The shipped admission
// policy refuses, whatever taintKey says; the mesh's own taint stays
// removable (TestNodeReadyOwnNodePolicy).
func TestTaintKeyOutsideTheMeshRefused(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	dedicated := corev1.Taint{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoSchedule}
	mine := createTestNode(t, ctx, "nr-dedicated", dedicated)
	inst := installDeploy(t, ctx, `namePrefix: e2e-ded-
patches:
  - target: {kind: ValidatingAdmissionPolicy, name: ambientd-own-node-only}
    patch: |-
      - op: test
        path: /spec/variables/8/name
        value: taintKey
      - op: replace
        path: /spec/variables/8/expression
        value: "'dedicated'"`)
	other := createTestNode(t, ctx, "nr-dedicated-other")
	agent, err := kubernetes.NewForConfig(inst.token(t, ctx, mine))
	if err != nil {
		t.Fatal(err)
	}
	// Policies take effect asynchronously: wait until a write to another
	// node is refused before the attack.
	probe := []byte(`{"metadata":{"annotations":{"e2e.ambientd.io/probe":"x"}}}`)
	var lastErr error
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, lastErr = agent.CoreV1().Nodes().Patch(ctx, other, types.StrategicMergePatchType, probe, metav1.PatchOptions{})
		return isDenied(lastErr), nil
	}); err != nil {
		t.Fatalf("policy never enforced; last write to %s: %v", other, lastErr)
	}
	// The node's taints without `dedicated` (only that one changes).
	n, err := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, mine, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rest := slices.DeleteFunc(slices.Clone(n.Spec.Taints), func(x corev1.Taint) bool { return x.Key == dedicated.Key })
	untaint, err := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec/taints", "value": rest}})
	if err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, lastErr = agent.CoreV1().Nodes().Patch(ctx, mine, types.JSONPatchType, untaint, metav1.PatchOptions{})
		if lastErr == nil {
			return true, nil
		}
		return isDenied(lastErr) && strings.Contains(lastErr.Error(), "only a taint of the mesh"), nil
	})
	if err != nil || lastErr == nil {
		n, _ := testEnv.CP.Admin.CoreV1().Nodes().Get(ctx, mine, metav1.GetOptions{})
		t.Fatalf("removing the dedicated taint with the agent's identity: %v (last answer %v); taints now %v", err, lastErr, n.Spec.Taints)
	}
	t.Logf("refused: %v", lastErr)
}
