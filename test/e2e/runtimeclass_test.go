//go:build e2e

package e2e

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// TestSandboxedRuntimeNeverInMesh: a pod whose RuntimeClass runs it under a
// sandboxed runtime (gVisor's runsc, Kata) is never reported in the mesh,
// since the in-pod rules do not see its traffic. An agent that lists runsc
// as capturable (through AMBIENTD_CAPTURABLE_RUNTIME_HANDLERS) enrolls such
// a pod; restarted with the default list it takes it out of the mesh:
// annotation removed, condition False/RuntimeNotCapturable, an Event,
// ztunnel no longer carrying it, its rules gone. A new mesh pod under runsc
// has its CNI ADD refused with a message naming the handler and the opt-out
// label, and shows why on the pod. A runc pod is enrolled, a Kata pod
// opted out with istio.io/dataplane-mode=none starts, and a running runsc
// pod whose namespace joins the mesh is not enrolled and shows why.
func TestSandboxedRuntimeNeverInMesh(t *testing.T) {
	s := newScenario(t, "rtclass", agentEnv("AMBIENTD_CAPTURABLE_RUNTIME_HANDLERS=default,runc,runsc"))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	admin := testEnv.CP.Admin

	// RuntimeClasses as a cluster with gVisor and Kata has them.
	class := func(handler string) *string {
		name := nsName + "-" + handler
		if _, err := admin.NodeV1().RuntimeClasses().Create(ctx, &nodev1.RuntimeClass{
			ObjectMeta: metav1.ObjectMeta{Name: name}, Handler: handler}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = admin.NodeV1().RuntimeClasses().Delete(context.Background(), name, metav1.DeleteOptions{}) })
		return &name
	}
	gvisor, kata, runc := class("runsc"), class("kata-qemu"), class("runc")
	under := func(rc *string) func(*corev1.Pod) { return func(p *corev1.Pod) { p.Spec.RuntimeClassName = rc } }
	notCapturable := func(p *corev1.Pod) *corev1.Pod {
		t.Helper()
		o, err := testEnv.WaitForPod(ctx, p.Namespace, p.Name, func(o *corev1.Pod) (bool, error) {
			c := enrolledCondition(o)
			return c != nil && c.Status == corev1.ConditionFalse && c.Reason == agent.ReasonRuntimeNotCapturable, nil
		})
		if err != nil {
			t.Fatalf("pod %s/%s: condition False/%s: %v", p.Namespace, p.Name, agent.ReasonRuntimeNotCapturable, err)
		}
		if v, has := o.Annotations[annRedirect]; has {
			t.Errorf("pod %s under an uncapturable runtime annotated %s=%q", p.Name, annRedirect, v)
		}
		if c := enrolledCondition(o); !strings.Contains(c.Message, `"runsc"`) || !strings.Contains(c.Message, "istio.io/dataplane-mode=none") {
			t.Errorf("pod %s condition message %q: want the handler and the opt-out label named", p.Name, c.Message)
		}
		ev := podEvents(t, ctx, &e2eenv.Pod{Namespace: p.Namespace, Name: p.Name, UID: string(p.UID)}, agent.EventRuntimeNotCapturable)
		if ev[0].Type != corev1.EventTypeWarning || !strings.Contains(ev[0].Message, "runsc") {
			t.Errorf("pod %s Event %s %q: want a Warning naming the handler", p.Name, ev[0].Type, ev[0].Message)
		}
		return o
	}

	// 1. Trusted by this agent's setting: enrolled like any pod.
	trusted := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "trusted", Mutate: under(gvisor)})
	waitAnnotation(t, ctx, trusted, "enabled")

	// 2. The default list: the pod is taken out of the mesh.
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	a.Env = []string{"AMBIENTD_RUN_DIR=" + testEnv.AgentRunDir}
	startAndAwaitSnapshot(t, ctx, a, em)
	notCapturable(trusted.Object)
	// ztunnel no longer carries it: dropped by the new connection's
	// snapshot, or by a Del after it.
	waitEmu(t, ctx, em, "ztunnel carries the pod no more", func(st ztunnelemu.State) bool {
		return !slices.ContainsFunc(st.Workloads, func(w ztunnelemu.Workload) bool { return w.UID == trusted.UID })
	})
	if rules := podRules(t, trusted); rules != "" {
		t.Errorf("rules left in the pod taken out of the mesh:\n%s", rules)
	}

	// 3. A new mesh pod under gVisor: its ADD is refused, it says why.
	obj, err := admin.CoreV1().Pods(nsName).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "refused"},
		Spec: corev1.PodSpec{NodeName: testEnv.NodeName, RuntimeClassName: gvisor, TerminationGracePeriodSeconds: new(int64),
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/e2e/app:1"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = admin.CoreV1().Pods(nsName).Delete(context.Background(), obj.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	if p, err := testEnv.AttachPod(ctx, obj, nil); err == nil {
		_ = testEnv.DeletePod(ctx, p)
		t.Fatal("CNI ADD of a mesh pod under runsc succeeded; want it refused")
	} else if !strings.Contains(err.Error(), `"runsc"`) || !strings.Contains(err.Error(), "istio.io/dataplane-mode=none") {
		t.Errorf("CNI ADD refused with %v; want the handler and the opt-out label named", err)
	}
	notCapturable(obj)

	// 4. runc is capturable; a Kata pod opted out starts outside the mesh.
	plain := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "plain", Mutate: under(runc)})
	waitAnnotation(t, ctx, plain, "enabled")
	optedOut := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "opted-out", Labels: map[string]string{labelMode: "none"}, Mutate: under(kata)})

	// 5. A running gVisor pod whose namespace joins the mesh.
	later := uniqueNS("rtclass-later")
	createNamespace(t, ctx, later, false)
	running := createPod(t, ctx, e2eenv.PodSpec{Namespace: later, Name: "running", Mutate: under(gvisor)})
	setNamespaceMode(t, ctx, later, "ambient")
	notCapturable(running.Object)

	// The condition writes above came from syncs that had decided: no
	// rules and no Add for any refused or opted-out pod.
	st := emuState(t, ctx, em)
	for _, p := range []*e2eenv.Pod{running, optedOut} {
		if n := countOps(st, "add", p.UID); n != 0 {
			t.Errorf("pod %s Added to ztunnel %d times", p.Name, n)
		}
		if rules := podRules(t, p); rules != "" {
			t.Errorf("pod %s has rules:\n%s", p.Name, rules)
		}
	}
	if n := countOps(st, "add", string(obj.UID)); n != 0 {
		t.Errorf("refused pod Added to ztunnel %d times", n)
	}
	if v, has := annotationOf(t, ctx, optedOut); has {
		t.Errorf("opted-out Kata pod annotated %q", v)
	}
}
