//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// readyEndpoints returns the names of the pods the Service's
// EndpointSlices (kube-controller-manager's) list as ready.
func readyEndpoints(ctx context.Context, ns, service string) ([]string, error) {
	list, err := node.Env.CP.Admin.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + service})
	if err != nil {
		return nil, err
	}
	var out []string
	for _, s := range list.Items {
		for _, e := range s.Endpoints {
			if e.Conditions.Ready != nil && *e.Conditions.Ready && e.TargetRef != nil {
				out = append(out, e.TargetRef.Name)
			}
		}
	}
	slices.Sort(out)
	return out, nil
}

// ztunnelGoneDropsEndpoints: the readiness gate does its job when the
// node's ztunnel goes away. Two gated pods behind a Service are Ready and
// listed ready in its EndpointSlice; the emulator (the node's only ztunnel)
// is killed: after the agent's grace their condition turns
// False/ZtunnelUnavailable, kubelet makes them NotReady and the
// EndpointSlice drops them, so clients stop being sent to a node that
// refuses them. A ztunnel comes back: they are Ready and listed again.
func (r *agentRun) ztunnelGoneDropsEndpoints(t *testing.T, ctx context.Context) {
	r.ztunnelGoneDropsEndpointsOf(t, ctx, nodeenv.GatedPod)
}

// ztunnelGoneDropsEndpointsOf is ztunnelGoneDropsEndpoints with the pods
// made from manifest: GatedPod's gate written in it, or AppPod's none, which
// the installed admission (policy or webhook) must add.
func (r *agentRun) ztunnelGoneDropsEndpointsOf(t *testing.T, ctx context.Context, manifest func(name string) *corev1.Pod) {
	ns := ambientNamespace(t, ctx, "ambient-ztgone")
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		},
	}
	if _, err := node.Env.CP.Admin.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	names := []string{"web-0", "web-1"}
	for _, name := range names {
		p := manifest(name)
		p.Labels = map[string]string{"app": "web"}
		created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !hasGate(created) {
			t.Fatalf("%s created without the readiness gate (manifest's gates %v): %v", name, p.Spec.ReadinessGates, created.Spec.ReadinessGates)
		}
	}
	for _, name := range names {
		if _, err := waitPod(ctx, ns, name, podReady); err != nil {
			t.Fatal(err)
		}
	}
	waitEndpoints := func(what string, want []string) time.Time {
		t.Helper()
		var got []string
		err := nodeenv.Poll(ctx, what, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
			var err error
			got, err = readyEndpoints(ctx, ns, svc.Name)
			return err == nil && slices.Equal(got, want), err
		})
		if err != nil {
			t.Fatalf("%v (ready endpoints now %v)", err, got)
		}
		return time.Now()
	}
	waitEndpoints("both pods ready in the Service's EndpointSlice", names)

	killed := time.Now()
	if err := r.em.Kill(); err != nil {
		t.Fatalf("kill the emulator: %v", err)
	}
	r.em = nil
	for _, name := range names {
		p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool {
			c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
			return !podReady(p) && c != nil && c.Status == corev1.ConditionFalse && c.Reason == agent.ReasonZtunnelUnavailable
		})
		if err != nil {
			t.Fatal(err)
		}
		c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
		t.Logf("%s: ztunnel killed -> NotReady, condition %s/%s, after %v", name, c.Status, c.Reason, time.Since(killed).Round(time.Millisecond))
	}
	dropped := waitEndpoints("both pods dropped from the Service's ready endpoints", nil)
	t.Logf("ztunnel killed -> EndpointSlice lists no ready pod after %v (grace %v)", dropped.Sub(killed).Round(time.Millisecond), agent.DefaultZtunnelGrace)

	var err error
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	for _, name := range names {
		if _, err := waitPod(ctx, ns, name, podReady); err != nil {
			t.Fatal(fmt.Errorf("after ztunnel came back: %w", err))
		}
	}
	returned := waitEndpoints("both pods ready in the EndpointSlice again", names)
	t.Logf("ztunnel back -> both pods Ready and in the EndpointSlice after %v", returned.Sub(back).Round(time.Millisecond))
	// The agent's own pod was NotReady without ztunnel (its /readyz);
	// the next steps start from a Ready agent.
	if err := nodeenv.Poll(ctx, "the agent's pod Ready again", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		pods, err := node.Env.CP.Admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "app=ambientd"})
		if err != nil {
			return false, err
		}
		return len(pods.Items) == 1 && podReady(&pods.Items[0]), nil
	}); err != nil {
		t.Fatal(err)
	}
}
