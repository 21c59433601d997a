//go:build e2enode

package e2enode

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// agentPodForceDeletedKeepsPlugin: the agent's pod is force-deleted
// (`kubectl delete pod --force --grace-period=0`) while its DaemonSet stays.
// The dying agent's token is refused once its pod is gone, which must not
// read as an uninstall: the plugin stays in the runtime's CNI config at
// every moment of the swap (sampled every 20 ms), the dying agent logs that
// it leaves the plugin, and its replacement becomes Ready with the plugin
// installed. Pods created through the swap (every 300 ms for the first
// swapFastPods, then every second, at most swapMaxPods) in an ambient
// namespace each either wait (their sandbox is refused while no agent
// answers) or start captured — the agent answered the CNI ADD that put the
// rules into the netns their app runs in before the app started — never
// uncaptured; all end enrolled, Ready and held by ztunnel.
//
// The same with the agent's ServiceAccount deleted and recreated first
// (its old token is then refused: 401), and its pod deleted the ordinary
// way: the refused agent must not take the refusal for an uninstall.
func (r *agentRun) agentPodForceDeletedKeepsPlugin(t *testing.T, ctx context.Context) {
	r.ensureInstalled(t, ctx)
	t.Run("PodForceDeleted", func(t *testing.T) {
		r.agentSwapKeepsPlugin(t, ctx, "ambient-forcedel", nil, []string{"--force", "--grace-period=0"})
	})
	t.Run("ServiceAccountRecreated", func(t *testing.T) {
		r.serveAndWaitReady(t, ctx)
		r.agentSwapKeepsPlugin(t, ctx, "ambient-sarecreated", recreateServiceAccount, nil)
	})
}

// recreateServiceAccount deletes and recreates the agent's ServiceAccount
// and waits until the agent pod's token is refused (the API server caches
// a token's success for a few seconds).
func recreateServiceAccount(t *testing.T, ctx context.Context, agent *corev1.Pod) {
	admin := node.Env.CP.Admin
	sa, err := admin.CoreV1().ServiceAccounts("istio-system").Get(ctx, "ambientd", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := admin.CoreV1().ServiceAccounts("istio-system").Delete(ctx, "ambientd", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().ServiceAccounts("istio-system").Create(ctx, &corev1.ServiceAccount{
		ObjectMeta: metav1.ObjectMeta{Name: sa.Name, Labels: sa.Labels, Annotations: sa.Annotations},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tokens, _ := filepath.Glob(filepath.Join(node.Dir, "kubelet", "root", "pods", string(agent.UID), "volumes", "kubernetes.io~projected", "*", "token"))
	if len(tokens) == 0 {
		t.Fatalf("no projected token of the agent pod %s under the kubelet's root dir", agent.Name)
	}
	tok, err := os.ReadFile(tokens[0])
	if err != nil {
		t.Fatal(err)
	}
	cfg := rest.CopyConfig(node.Env.CP.AdminConfig)
	cfg.BearerToken, cfg.BearerTokenFile = string(tok), ""
	as, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	recreated := time.Now()
	if err := nodeenv.Poll(ctx, "the agent's token refused", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := as.AppsV1().DaemonSets("istio-system").Get(ctx, "ambientd", metav1.GetOptions{})
		return apierrors.IsUnauthorized(err), nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("ServiceAccount recreated -> the agent's token refused: %s", time.Since(recreated).Round(time.Millisecond))
}

// The pods created through a swap: fast at first (the swap's start), then
// one a second, so that a swap that takes a minute on a loaded machine
// (the replacement is created only once the old pod is gone) still gets new
// pods all through it without reaching the kubelet's 110-pod limit (pods
// the scheduler cannot place would never start and fail the test).
const (
	swapFastPods = 30
	swapMaxPods  = 80
)

// agentSwapKeepsPlugin runs before (when set), deletes the agent's pod with
// the extra kubectl flags, and checks the swap (see
// agentPodForceDeletedKeepsPlugin).
func (r *agentRun) agentSwapKeepsPlugin(t *testing.T, ctx context.Context, nsName string, before func(*testing.T, context.Context, *corev1.Pod), deleteFlags []string) {
	admin := node.Env.CP.Admin
	ns := ambientNamespace(t, ctx, nsName)
	old, err := node.AgentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("agent pod: %v", err)
	}
	if !pluginInstalled(t) {
		t.Fatalf("plugin not installed before the swap: %s", runtimeConfig(t))
	}

	// The dying agent's log: its pod object is gone after the delete, so
	// follow it from before.
	var oldLog bytes.Buffer
	follow := exec.CommandContext(ctx, node.Bins.Kubectl, "--kubeconfig", node.Env.CP.AdminKubeconfig,
		"logs", "-f", "-n", "istio-system", old.Name)
	follow.Stdout = &oldLog // read after Wait: the copier is done then
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	followed := make(chan struct{})
	go func() { _ = follow.Wait(); close(followed) }()
	t.Cleanup(func() { _ = follow.Process.Kill(); <-followed })

	// The plugin in the runtime's config, sampled through the swap.
	sampleCtx, stopSampling := context.WithCancel(ctx)
	var missing []string
	samples := 0
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampleCtx.Err() == nil {
			ok, err := node.PluginInstalled()
			samples++
			if err != nil || !ok {
				missing = append(missing, fmt.Sprintf("%s: %v %v", time.Now().Format(time.RFC3339Nano), ok, err))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	// Pods created through the swap.
	createCtx, stopCreating := context.WithCancel(ctx)
	var created []string
	creating := make(chan struct{})
	go func() {
		defer close(creating)
		for i := 0; createCtx.Err() == nil && i < swapMaxPods; i++ {
			name := fmt.Sprintf("swap-%d", i)
			if _, err := admin.CoreV1().Pods(ns).Create(createCtx, nodeenv.GatedPod(name), metav1.CreateOptions{}); err == nil {
				created = append(created, name)
			} else if createCtx.Err() == nil {
				t.Errorf("create %s: %v", name, err)
			}
			interval := 300 * time.Millisecond
			if i >= swapFastPods {
				interval = time.Second
			}
			select {
			case <-createCtx.Done():
			case <-time.After(interval):
			}
		}
	}()
	time.Sleep(time.Second) // a few pods before the delete

	if before != nil {
		before(t, ctx, old)
	}
	deleted := time.Now()
	if _, err := node.Kubectl(ctx, append([]string{"delete", "pod", "-n", "istio-system", old.Name}, deleteFlags...)...); err != nil {
		t.Fatal(err)
	}
	var replacement *corev1.Pod
	if err := nodeenv.Poll(ctx, "the replacement agent pod Ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		if err != nil || p == nil || p.UID == old.UID {
			return false, err
		}
		replacement = p
		return podReady(p), nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("delete -> replacement %s Ready: %s", replacement.Name, time.Since(deleted).Round(time.Millisecond))
	time.Sleep(2 * time.Second) // a few pods after
	stopCreating()
	<-creating
	stopSampling()
	<-sampled

	if len(missing) > 0 {
		t.Errorf("the plugin was missing from the runtime's CNI config in %d of %d samples through the swap: %v", len(missing), samples, missing)
	}
	if !pluginInstalled(t) {
		t.Errorf("plugin gone from the runtime's CNI config after the swap: %s", runtimeConfig(t))
	}

	_ = follow.Process.Kill()
	<-followed
	oldLogs := oldLog.String()
	for _, line := range strings.Split(oldLogs, "\n") {
		if strings.Contains(line, "CNI plugin") || strings.Contains(line, "DaemonSet") || strings.Contains(line, "shutting down") {
			t.Logf("deleted agent: %s", line)
		}
	}
	if !strings.Contains(oldLogs, "leaving the CNI plugin") {
		t.Errorf("the deleted agent did not log that it leaves the plugin (an upgrade, not an uninstall); its log's end:\n%s", tail(oldLogs, 30))
	}

	var ready []*corev1.Pod
	for _, name := range created {
		p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool {
			return podReady(p) && p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled
		})
		if err != nil {
			t.Errorf("pod %s created through the swap: %v; %s", name, err, describe(p))
			continue
		}
		ready = append(ready, p)
	}
	// Read after every pod started: a pod that waited was added by the
	// replacement later.
	newLog, err := node.Kubectl(ctx, "logs", "-n", "istio-system", replacement.Name)
	if err != nil {
		t.Fatal(err)
	}
	logs := oldLogs + "\n" + newLog
	waited, uncaptured := 0, 0
	for _, p := range ready {
		netnsPath, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
		if err != nil {
			t.Fatal(err)
		}
		started := appStartedAt(t, ctx, ns, p.Name)
		rulesAt, _, ok := ruledAtIn(logs, string(p.UID), netnsPath)
		switch {
		case !ok:
			uncaptured++
			t.Errorf("pod %s: no agent answered a CNI ADD enrolling its netns %s: it started uncaptured (app started %s)", p.Name, netnsPath, started.Format(time.RFC3339Nano))
		case !rulesAt.Before(started):
			uncaptured++
			t.Errorf("pod %s: its app started at %s, before the agent answered the CNI ADD for its netns (%s): it ran uncaptured", p.Name, started.Format(time.RFC3339Nano), rulesAt.Format(time.RFC3339Nano))
		}
		evs, err := admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name + ",reason=FailedCreatePodSandBox"})
		if err == nil && len(evs.Items) > 0 {
			waited++
		}
		uid := string(p.UID)
		r.waitEmu(t, ctx, "pod "+p.Name+" held by ztunnel", func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	}
	t.Logf("%d pods created through the swap: %d Ready and enrolled, %d started uncaptured, %d waited (sandbox refused while no agent answered); the plugin was missing from the runtime's config in %d of %d samples",
		len(created), len(ready), uncaptured, waited, len(missing), samples)
	deletePodsAndWait(t, ctx, ns, metav1.ListOptions{})
}

// deletePodsAndWait deletes the pods of namespace ns that sel selects, the
// ordinary way (the kubelet stops them and tears their sandboxes down), and
// waits until the API holds none of them: pods still terminating count
// against the node's pod limit for the tests that follow, and the
// namespace's own deletion at cleanup does not wait.
func deletePodsAndWait(t *testing.T, ctx context.Context, ns string, sel metav1.ListOptions) {
	t.Helper()
	pods := node.Env.CP.Admin.CoreV1().Pods(ns)
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, sel); err != nil {
		t.Fatalf("deleting pods of %s (%+v): %v", ns, sel, err)
	}
	left := 0
	if err := nodeenv.Poll(ctx, "pods of "+ns+" gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		l, err := pods.List(ctx, sel)
		if err != nil {
			return false, err
		}
		left = len(l.Items)
		return left == 0, nil
	}); err != nil {
		t.Fatalf("%d pods of %s still in the API: %v", left, ns, err)
	}
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
