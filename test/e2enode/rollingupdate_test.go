//go:build e2enode

package e2enode

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// rollingUpdateKeepsCapture: the DaemonSet is updated to another image tag
// (the same image, retagged in containerd); kubelet replaces the agent's
// pod. An enrolled pod never gets a Del and stays Ready; a pod created right
// after the update started ends enrolled and Ready.
func (r *agentRun) rollingUpdateKeepsCapture(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-update")
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("before"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	if _, err := waitPod(ctx, ns, "before", podReady); err != nil {
		t.Fatal(err)
	}
	old, err := node.AgentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("agent pod: %v", err)
	}
	const newTag = "dev-update"
	out, err := exec.CommandContext(ctx, node.Bins.Ctr, "--address", node.ContainerdAddress, "--namespace", "k8s.io",
		"images", "tag", "--force", nodeenv.AgentImage+":"+nodeenv.AgentTag, nodeenv.AgentImage+":"+newTag).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images tag: %v: %s", err, out)
	}
	start := time.Now()
	if _, err := node.Kubectl(ctx, "apply", "-k", overlay(t, newTag)); err != nil {
		t.Fatal(err)
	}
	// A pod created while no agent serves the node (the old agent has
	// stopped answering on its CNI socket, the new one does not answer yet):
	// its sandbox must wait (the plugin fails the ADD, kubelet retries) and
	// start captured.
	waitCNIUnserved(t, ctx)
	gap := time.Now()
	t.Logf("apply new tag -> old agent stopped serving CNI: %s", gap.Sub(start).Round(time.Millisecond))
	during, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("during"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "DaemonSet rolled to "+newTag, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		if err != nil || p == nil || p.UID == old.UID {
			return false, err
		}
		return p.Spec.Containers[0].Image == nodeenv.AgentImage+":"+newTag && podReady(p), nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("apply new tag -> new agent pod Ready: %s", time.Since(start).Round(time.Millisecond))
	duringPod, err := waitPod(ctx, ns, "during", podReady)
	if err != nil {
		t.Fatal(err)
	}
	r.capturedBeforeStart(t, ctx, duringPod)
	evs, err := node.Env.CP.Admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=during,reason=FailedCreatePodSandBox"})
	if err != nil {
		t.Fatal(err)
	}
	waited := 0
	for _, e := range evs.Items {
		if strings.Contains(e.Message, "ambientd agent unreachable") {
			waited += int(max(e.Count, 1))
		}
	}
	t.Logf("pod created in the gap: %d sandbox attempts refused while no agent served (kubelet retried), Ready %s after creation",
		waited, time.Since(gap).Round(time.Millisecond))
	r.keptThroughTheRoll(t, ctx, "the update", uid, string(during.UID))
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "before", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("enrolled pod after the update: %s (%v)", describe(p), err)
	}
	if !pluginInstalled(t) {
		t.Errorf("plugin gone from the runtime's CNI config after the update: %s", runtimeConfig(t))
	}
}
