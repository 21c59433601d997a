//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// hostNetworkPodNeverAPod: a hostNetwork pod in an
// ambient namespace annotated ambient.istio.io/redirection=enabled (anyone
// who may annotate a pod can do that), then an agent restart. The host is
// never treated as a pod: ztunnel gets no Add carrying the node's netns, and
// the node's nftables host table (probe SNAT) and every meshed pod's probe
// entry survive. The annotation is set while the agent is frozen (SIGSTOP),
// so only the restart's rebuild sees it (a running agent cleans it first);
// the agent is then SIGKILLed and kubelet restarts its container.
func (r *agentRun) hostNetworkPodNeverAPod(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-hostnet")
	meshed, _ := startPod(t, ctx, ns, nodeenv.GatedPod("meshed"))
	meshedIP := meshed.Status.PodIP
	if !strings.Contains(hostProbeTable(t, ctx), meshedIP) {
		t.Fatalf("meshed pod %s not in the host probe set before the test:\n%s", meshedIP, hostProbeTable(t, ctx))
	}
	hostSpec := appPodSpec()
	hostSpec.HostNetwork = true
	hostPod, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "hostnet"}, Spec: hostSpec}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := waitPod(ctx, ns, "hostnet", podReady); err != nil {
		t.Fatal(err)
	}
	hostIno := inodeOf("/proc/self/ns/net")
	agentPod, err := node.AgentPod(ctx)
	if err != nil || agentPod == nil {
		t.Fatalf("agent pod: %v", err)
	}
	restarts := agentPod.Status.ContainerStatuses[0].RestartCount
	var st0 ztunnelemu.State
	if err := r.em.State(ctx, &st0); err != nil {
		t.Fatal(err)
	}

	pid := agentProcess(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"enabled"}}}`, podmeta.AnnotationRedirection)
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Patch(ctx, "hostnet", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	if err := nodeenv.Poll(ctx, "the agent restarted and Ready, the hostNetwork pod's annotation cleaned", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		if err != nil || p == nil || len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].RestartCount <= restarts || !podReady(p) {
			return false, err
		}
		h, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "hostnet", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		_, annotated := h.Annotations[podmeta.AnnotationRedirection]
		return !annotated, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("agent SIGKILLed -> restarted, Ready, the hostNetwork pod's annotation gone: %s", time.Since(restarted).Round(time.Millisecond))

	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	for _, q := range st.Requests[len(st0.Requests):] {
		if q.NetnsInode == hostIno || q.UID == string(hostPod.UID) {
			t.Errorf("ztunnel got %s for %s/%s carrying netns inode %d (the node's is %d)", q.Op, q.Namespace, q.Name, q.NetnsInode, hostIno)
		}
	}
	table := hostProbeTable(t, ctx)
	if !strings.Contains(table, "postrouting") || !strings.Contains(table, "istio-inpod-probes-v4") || !strings.Contains(table, meshedIP) {
		t.Errorf("after the restart the node's host table lost its probe SNAT or the meshed pod's entry %s:\n%s", meshedIP, table)
	}
	for _, chain := range []string{"istio-prerouting", "istio-output"} {
		if strings.Contains(table, "chain "+chain) {
			t.Errorf("in-pod chain %s in the node's own netns:\n%s", chain, table)
		}
	}
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "meshed", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("meshed pod after the restart: %s (%v)", describe(p), err)
	}
	if w, ok := st.Workload(string(meshed.UID)); !ok {
		t.Errorf("ztunnel lost the meshed pod after the restart")
	} else {
		t.Logf("meshed pod held with netns inode %d; requests since the freeze: %d", w.NetnsInode, len(st.Requests)-len(st0.Requests))
	}
}
