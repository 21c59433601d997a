//go:build e2e

package e2e

// End-to-end tests of the agent's restart: SIGKILLed with pods enrolled, its
// successor hands ztunnel the same pods (found in the real /proc).

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// TestAgentRestartKeepsPods: SIGKILL the agent with 10 pods enrolled; the
// reconnecting ztunnel's first snapshot holds exactly those pods, each as an
// Add with its netns (found by one scan of the real /proc through the pods'
// sandbox processes), nothing is dropped, rules are untouched, and a new pod
// enrolls afterwards.
func TestAgentRestartKeepsPods(t *testing.T) {
	s := newScenario(t, "restart", within(6*time.Minute))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent

	var pods []*e2eenv.Pod
	rulesBefore := map[string]string{}
	for i := range 10 {
		pods = append(pods, createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: fmt.Sprintf("p%d", i)}))
	}
	var uids []string
	for _, p := range pods {
		waitAnnotation(t, ctx, p, "enabled")
		rulesBefore[p.UID] = podRules(t, p)
		uids = append(uids, p.UID)
	}
	sort.Strings(uids)
	if want := annotatedUIDs(t, ctx); !slices.Equal(uids, want) {
		t.Fatalf("node has other enrolled pods %v besides this test's %v", want, uids)
	}
	if err := a.Kill(); err != nil {
		t.Fatalf("SIGKILL agent: %v", err)
	}
	st, c := startAndAwaitSnapshot(t, ctx, a, em)
	var got []string
	adds := 0
	for _, it := range c.Snapshot {
		got = append(got, it.UID)
		if it.Op == "add" {
			adds++
		}
	}
	sort.Strings(got)
	if !slices.Equal(got, uids) {
		t.Errorf("first snapshot after restart %v, want exactly %v", got, uids)
	}
	if adds != len(pods) {
		t.Errorf("snapshot has %d Adds, want %d: the /proc scan must find every pod's netns (no Keep)", adds, len(pods))
	}
	inodes := addInodes(st, c)
	for _, p := range pods {
		if got, want := inodes[p.UID], netnsInode(t, p); got != want {
			t.Errorf("pod %s: Add after restart carried netns inode %d, want %d", p.Name, got, want)
		}
		if countOps(st, "del", p.UID) != 0 {
			t.Errorf("pod %s: Del sent across the restart", p.Name)
		}
		if _, ok := st.Workload(p.UID); !ok {
			t.Errorf("emulator dropped pod %s after the restart", p.Name)
		}
		if after := podRules(t, p); after != rulesBefore[p.UID] {
			t.Errorf("pod %s rules changed across restart:\nbefore:\n%s\nafter:\n%s", p.Name, rulesBefore[p.UID], after)
		}
	}
	if len(st.ProtocolErrors) > 0 {
		t.Errorf("protocol errors: %+v", st.ProtocolErrors)
	}

	fresh := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "after-restart"})
	waitAnnotation(t, ctx, fresh, "enabled")
	for _, p := range pods {
		if v, _ := annotationOf(t, ctx, p); v != "enabled" {
			t.Errorf("pod %s annotation %q after restart", p.Name, v)
		}
	}
}

// TestAgentRestartBeforeAnnotationLands: pods enrolled while the kube-apiserver
// is stopped reach ztunnel, but their annotation patches stay queued; the
// agent is SIGKILLed before the API returns, so they never land. After the API
// is back (and the kubelet has reported the pods Running), the restarted
// agent's first snapshot must still hold those pods, as Adds with their netns
// (found in /proc through their sandbox processes): ztunnel must not drop
// them. Then they are enabled normally, with their rules in place.
func TestAgentRestartBeforeAnnotationLands(t *testing.T) {
	const n = 3
	s := newScenario(t, "restartapi", within(6*time.Minute))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	// The scheduler's part while the API is up; the agent's cache must know
	// the pods before the API goes away.
	cachedBefore := informerPods(t, ctx, a)
	var objs []*corev1.Pod
	for i := range n {
		objs = append(objs, createObjectOnly(t, ctx, nsName, fmt.Sprintf("lost-%d", i)))
	}
	testutil.Until(t, ctx, "agent cache has the new pods", func() bool { return informerPods(t, ctx, a) >= cachedBefore+n })

	restartAPIServer := stopAPIServer(t, ctx)

	// The runtime's part with the API down: sandbox + CNI chain. The agent
	// programs the rules and ztunnel acks; the annotation patches queue.
	var pods []*e2eenv.Pod
	for _, o := range objs {
		p, err := testEnv.AttachPod(ctx, o, nil)
		if err != nil {
			t.Fatalf("CNI ADD of %s with the API down: %v", o.Name, err)
		}
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := testEnv.DeletePod(cctx, p); err != nil {
				t.Errorf("delete pod %s: %v", p.Name, err)
			}
		})
		pods = append(pods, p)
	}
	waitEmu(t, ctx, em, "the pods enrolled while the API is down", func(s ztunnelemu.State) bool {
		for _, p := range pods {
			if _, ok := s.Workload(p.UID); !ok {
				return false
			}
		}
		return true
	})
	rulesBefore := map[string]string{}
	for _, p := range pods {
		rulesBefore[p.UID] = podRules(t, p)
		if !strings.Contains(rulesBefore[p.UID], "ISTIO_OUTPUT") {
			t.Fatalf("pod %s has no rules after its CNI ADD:\n%s", p.Name, rulesBefore[p.UID])
		}
	}

	// The agent dies before the API is back: the queued patches are lost.
	if err := a.Kill(); err != nil {
		t.Fatalf("SIGKILL agent: %v", err)
	}
	restartAPIServer()
	// The kubelet's status update, once it reaches the API again: Running
	// with the IPs, except the last pod, still running its init containers
	// (phase Pending with its IPs). For the Running pods the restarted agent's
	// reconcile may enroll them again before the emulator reconnects (its
	// backoff), hiding a missing restore; the init pod is never enrolled by
	// the reconcile before it runs, so only the restore can keep it.
	for i, p := range pods {
		var obj *corev1.Pod
		var err error
		if i < n-1 {
			obj, err = testEnv.MarkRunning(ctx, objs[i], p.IPs)
		} else {
			obj, err = markInitializing(ctx, p)
		}
		if err != nil {
			t.Fatal(err)
		}
		if v, ok := obj.Annotations[annRedirect]; ok {
			t.Fatalf("pod %s has %s=%q: the annotation landed, the restart gap is not exercised", p.Name, annRedirect, v)
		}
	}

	st, c := startAndAwaitSnapshot(t, ctx, a, em)
	ops := map[string]string{}
	for _, it := range c.Snapshot {
		ops[it.UID] = it.Op
	}
	inodes := addInodes(st, c)
	for _, p := range pods {
		if ops[p.UID] != "add" {
			t.Errorf("pod %s: first snapshot after restart has %q for it, want an Add (snapshot %+v)", p.Name, ops[p.UID], c.Snapshot)
		}
		if got, want := inodes[p.UID], netnsInode(t, p); got != want {
			t.Errorf("pod %s: Add after restart carried netns inode %d, want %d", p.Name, got, want)
		}
		if _, ok := st.Workload(p.UID); !ok {
			t.Errorf("emulator dropped pod %s after the restart", p.Name)
		}
	}

	if t.Failed() {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, p := range pods {
		waitAnnotation(t, wctx, p, "enabled")
		if after := podRules(t, p); after != rulesBefore[p.UID] {
			t.Errorf("pod %s rules changed across restart:\nbefore:\n%s\nafter:\n%s", p.Name, rulesBefore[p.UID], after)
		}
	}
	st = emuState(t, ctx, em)
	for _, p := range pods {
		if countOps(st, "del", p.UID) != 0 {
			t.Errorf("pod %s: Del sent across the restart", p.Name)
		}
		if _, ok := st.Workload(p.UID); !ok {
			t.Errorf("emulator does not serve pod %s after it was enabled", p.Name)
		}
	}
	if len(st.ProtocolErrors) > 0 {
		t.Errorf("protocol errors: %+v", st.ProtocolErrors)
	}
}

// markInitializing reports the pod as the kubelet does while its init
// containers run: phase Pending, sandbox IPs assigned.
func markInitializing(ctx context.Context, p *e2eenv.Pod) (*corev1.Pod, error) {
	obj, err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	now := metav1.Now()
	obj.Status.Phase = corev1.PodPending
	obj.Status.HostIP = "127.0.0.1"
	obj.Status.HostIPs = []corev1.HostIP{{IP: "127.0.0.1"}}
	obj.Status.PodIP = p.IPs[0].String()
	obj.Status.PodIPs = nil
	for _, ip := range p.IPs {
		obj.Status.PodIPs = append(obj.Status.PodIPs, corev1.PodIP{IP: ip.String()})
	}
	obj.Status.StartTime = &now
	obj.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodInitialized, Status: corev1.ConditionFalse, LastTransitionTime: now},
	}
	return testEnv.CP.Admin.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, obj, metav1.UpdateOptions{})
}
