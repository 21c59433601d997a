//go:build e2e

package e2e

// End-to-end tests of issue 22 ("Ready means meshed for every pod"): the
// no-deadlock rule of the agent for gated pods it does not enroll.

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// TestAdmissionGateNeverDeadlocks: pods that carry the readiness gate but
// that the agent does not enroll — labelled `none` after admission added
// the gate, gated by hand in a namespace outside the mesh, sidecar-injected
// after the gate was added — get True/NotInMesh from the agent, so kubelet
// can turn them Ready. A pod without the gate and outside the mesh gets no
// condition at all (the agent does not write to pods it has no business
// with).
func TestAdmissionGateNeverDeadlocks(t *testing.T) {
	ctx := testContext(t, 3*time.Minute)
	ambientNS, plainNS := uniqueNS("gate-amb"), uniqueNS("gate-plain")
	createNamespace(t, ctx, ambientNS, true)
	createNamespace(t, ctx, plainNS, false)
	startAgent(t, ctx)
	startEmulator(t, ctx, "gate")

	optedOut := createPod(t, ctx, e2eenv.PodSpec{Namespace: ambientNS, Name: "opted-out", Labels: map[string]string{labelMode: "none"}, Mutate: gated})
	plain := createPod(t, ctx, e2eenv.PodSpec{Namespace: plainNS, Name: "gated-plain", Mutate: gated})
	sidecar := createPod(t, ctx, e2eenv.PodSpec{Namespace: ambientNS, Name: "sidecar", Annotations: map[string]string{annSidecar: "{}"}, Mutate: gated})
	ungated := createPod(t, ctx, e2eenv.PodSpec{Namespace: plainNS, Name: "ungated"})
	start := time.Now()
	for _, p := range []*e2eenv.Pod{optedOut, plain, sidecar} {
		o := waitPod(t, ctx, p, "condition True/NotInMesh", podConditionIs(corev1.ConditionTrue, agent.ReasonNotInMesh))
		if _, has := o.Annotations[annRedirect]; has {
			t.Errorf("%s: annotated %q though never enrolled", p.Name, o.Annotations[annRedirect])
		}
		if !kubeletWouldBeReady(o) {
			t.Errorf("%s: kubelet would keep it NotReady: conditions %+v", p.Name, o.Status.Conditions)
		}
	}
	t.Logf("gated pods out of the mesh: True/NotInMesh within %s of the last creation", time.Since(start).Round(time.Millisecond))
	// The agent synced the ungated pod too (same namespace as gated-plain,
	// created last): it must have left it alone.
	o, err := testEnv.CP.Admin.CoreV1().Pods(plainNS).Get(ctx, ungated.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if c := enrolledCondition(o); c != nil {
		t.Errorf("ungated pod outside the mesh got condition %+v", c)
	}
}
