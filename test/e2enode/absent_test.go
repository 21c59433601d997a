//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// EnvOutage sets how long imageThatCannotBePulled keeps the agent away
// (a Go duration; default 90s in make check, 15m for the long run in
// docs/bench/).
const EnvOutage = "AMBIENTD_OUTAGE"

// imageThatCannotBePulled: the DaemonSet's image set to a tag that does not
// exist — the rolling update deletes the running agent and its replacement
// never starts — while a plain pod and a mesh pod are created on the node
// every 30 s for the outage (nothing shortened but what a user could set).
// Plain pods start; mesh pods wait, and none ever runs uncaptured; the
// plugin stays installed. The image fixed, the waiting mesh pods start
// enrolled, and the node's Event tells what happened.
func (r *agentRun) imageThatCannotBePulled(t *testing.T, stepCtx context.Context) {
	outage := 90 * time.Second
	if v := os.Getenv(EnvOutage); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("%s=%q: %v", EnvOutage, v, err)
		}
		outage = d
	}
	// This step's own budget: the outage and the recovery.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(stepCtx), outage+4*time.Minute)
	defer cancel()
	r.serveAndWaitReady(t, ctx)
	admin := node.Env.CP.Admin
	mesh := ambientNamespace(t, ctx, "outage-mesh")
	if out, err := node.Kubectl(ctx, "set", "image", "-n", "istio-system", "daemonset/ambientd", "ambientd=ambientd.local/ambientd:does-not-exist"); err != nil {
		t.Fatalf("kubectl set image: %v\n%s", err, out)
	}
	restored := false
	restore := func() {
		if restored {
			return
		}
		restored = true
		// The overlay as the install wrote it (the earlier step's copy
		// may be gone with its temp dir).
		r.overlay = overlay(t, nodeenv.AgentTag)
		if out, err := node.Kubectl(context.Background(), "apply", "-k", r.overlay); err != nil {
			t.Errorf("restoring the DaemonSet: %v\n%s", err, out)
		}
	}
	t.Cleanup(restore)
	if err := nodeenv.Poll(ctx, "no agent container running on the node", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		running, err := agentRunning(ctx)
		return !running, err
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("the agent is gone and its replacement cannot pull its image; %v of pods every 30s", outage)

	var plain, meshPods []string
	create := func(ns, name string, labels map[string]string) {
		_, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}, Spec: appPodSpec()}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = admin.CoreV1().Pods(ns).Delete(context.Background(), name, metav1.DeleteOptions{})
		})
	}
	// noMeshPodRuns fails the test when any mesh pod has a container
	// running while no agent is there: it would run uncaptured.
	noMeshPodRuns := func() {
		for _, name := range meshPods {
			p, err := admin.CoreV1().Pods(mesh).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range p.Status.ContainerStatuses {
				if c.State.Running != nil || c.State.Terminated != nil {
					t.Fatalf("mesh pod %s/%s has a container started with no agent on the node: %s", mesh, name, describe(p))
				}
			}
		}
	}
	end := time.Now().Add(outage)
	for i := 0; time.Now().Before(end); i++ {
		tick := time.Now()
		plain = append(plain, fmt.Sprintf("outage-plain-%d", i))
		meshPods = append(meshPods, fmt.Sprintf("outage-mesh-%d", i))
		create(metav1.NamespaceDefault, plain[i], nil)
		create(mesh, meshPods[i], nil)
		if _, err := waitPod(ctx, metav1.NamespaceDefault, plain[i], podReady); err != nil {
			t.Fatalf("plain pod %s with no agent: %v", plain[i], err)
		}
		for time.Since(tick) < 30*time.Second && time.Now().Before(end) {
			noMeshPodRuns()
			if running, err := agentRunning(ctx); err != nil || running {
				t.Fatalf("an agent container runs (%v): the image was pulled after all", err)
			}
			time.Sleep(2 * time.Second)
		}
		if !pluginInstalled(t) {
			t.Fatalf("the plugin left the runtime's config %v into the outage:\n%s", time.Since(end.Add(-outage)).Round(time.Second), runtimeConfig(t))
		}
	}
	noMeshPodRuns()
	t.Logf("%d plain pods started, %d mesh pods waited, the plugin stayed installed", len(plain), len(meshPods))

	restore()
	r.serveAndWaitReady(t, ctx)
	for _, name := range meshPods {
		if _, err := waitPod(ctx, mesh, name, func(p *corev1.Pod) bool {
			return p.Status.Phase == corev1.PodRunning && p.Annotations[podmeta.AnnotationRedirection] == "enabled"
		}); err != nil {
			t.Fatalf("mesh pod %s/%s after the image was fixed: %v", mesh, name, err)
		}
	}
	ev := nodeEvent(t, ctx, daemon.EventAgentAbsent)
	if !strings.Contains(ev, "pods waited") || !strings.Contains(ev, "outside the mesh started") {
		t.Errorf("node Event: %q", ev)
	}
	t.Logf("node Event: %s", ev)
}

// agentRunning reports whether any of the DaemonSet's pods has its agent
// container running, as the kubelet reports it (a process scan would also
// see other suites' agents on this machine).
func agentRunning(ctx context.Context) (bool, error) {
	pods, err := node.Env.CP.Admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "app=ambientd"})
	if err != nil {
		return false, err
	}
	for _, p := range pods.Items {
		for _, c := range p.Status.ContainerStatuses {
			if c.State.Running != nil {
				return true, nil
			}
		}
	}
	return false, nil
}

// nodeEvent waits for the agent's Event of reason on the node and returns
// its message.
func nodeEvent(t *testing.T, ctx context.Context, reason string) string {
	t.Helper()
	var msg string
	if err := nodeenv.Poll(ctx, "node Event "+reason, time.Second, func(ctx context.Context) (bool, error) {
		evs, err := node.Env.CP.Admin.CoreV1().Events(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Node,reason=" + reason})
		if err != nil || len(evs.Items) == 0 {
			return false, nil
		}
		msg = evs.Items[len(evs.Items)-1].Message
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	return msg
}
