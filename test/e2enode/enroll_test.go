//go:build e2enode

package e2enode

import (
	"context"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// ambientPodEnrolledCapturedReady: a kubelet-created pod in an ambient
// namespace, with the enrolled readiness gate, is handed to ztunnel with its
// netns (the one containerd made), annotated enabled, captured both ways
// (its outbound connection lands on ztunnel's 15001, an inbound one on
// 15006), Ready only once ztunnel acked, and kubelet's HTTP probes keep
// passing through the probe SNAT. Then it is deleted by kubelet: ztunnel
// gets one Del, and containerd's repeated DEL (empty netns) changes nothing.
func (r *agentRun) ambientPodEnrolledCapturedReady(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-app")
	workload := ns + "/web"
	// While ztunnel refuses the Add, the gate keeps the pod not Ready.
	if err := r.em.SetNack(ctx, workload, "refused by the test"); err != nil {
		t.Fatal(err)
	}
	before, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("web"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	r.waitEmu(t, ctx, "a refused Add for "+workload, func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Requests, func(q ztunnelemu.RequestRecord) bool {
			return q.UID == uid && q.Op == "add" && q.AckError != ""
		})
	})
	// The agent recorded the refusal on the pod (pending; not Ready: the
	// gate holds it, while kubelet's probes pass through the probe SNAT).
	p, err := waitPod(ctx, ns, "web", func(p *corev1.Pod) bool {
		c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
		return p.Status.Phase == corev1.PodRunning && c != nil && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, "refused by the test")
	})
	if err != nil {
		t.Fatal(err)
	}
	if podReady(p) {
		t.Fatalf("pod Ready while ztunnel refuses it: %s", describe(p))
	}
	t.Logf("while refused: %s", describe(p))
	if err := r.em.ClearNack(ctx, workload); err != nil {
		t.Fatal(err)
	}
	p, err = waitPod(ctx, ns, "web", podReady)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod create -> Ready (first Add refused, then acked on the agent's retry): %s", time.Since(start).Round(time.Millisecond))
	if got := p.Annotations[podmeta.AnnotationRedirection]; got != "enabled" {
		t.Errorf("annotation %s = %q, want enabled", podmeta.AnnotationRedirection, got)
	}
	if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c == nil || c.Status != corev1.ConditionTrue {
		t.Errorf("condition %s: %+v, want True", nodeenv.EnrolledCondition, c)
	}

	after, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	netnsPath := newNetns(t, before, after)
	st := r.waitEmu(t, ctx, "workload "+uid, func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	w, _ := st.Workload(uid)
	if want := inode(t, netnsPath); w.NetnsInode != want {
		t.Errorf("ztunnel got netns inode %d, containerd's netns %s is %d", w.NetnsInode, netnsPath, want)
	}
	if w.Name != "web" || w.Namespace != ns {
		t.Errorf("ztunnel workload %+v: want %s", w, workload)
	}

	// Captured: outbound from the pod to the node's address lands on 15001
	// (the original destination preserved); inbound from another pod to the
	// app's port lands on 15006. (A connection from the node itself counts
	// as a probe: the host rules SNAT it past the capture, as kubelet's.)
	podIP := netip.MustParseAddr(p.Status.PodIP)
	outDst := netip.AddrPortFrom(node.IP, 9).String()
	dialFrom(t, ctx, netnsPath, outDst)
	clientNetns := plainClient(t, ctx)
	inDst := netip.AddrPortFrom(podIP, nodeenv.AppPort).String()
	dialFrom(t, ctx, clientNetns, inDst)
	st = r.waitEmu(t, ctx, "outbound and inbound connections accepted", func(s ztunnelemu.State) bool {
		out := slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
		in := slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15006 })
		return out && in
	})
	for _, a := range st.Accepted {
		if a.UID != uid {
			continue
		}
		if (a.Port == 15001 && a.OrigDst != outDst) || (a.Port == 15006 && a.OrigDst != inDst) {
			t.Errorf("accepted %+v: original destination should be %s (outbound) or %s (inbound)", a, outDst, inDst)
		}
	}

	// Kubelet's probes reach the app itself, from the probe SNAT address,
	// and keep passing: the pod stays Ready and the app logs new probes.
	probes := func() int {
		logs, err := node.Kubectl(ctx, "logs", "-n", ns, "web")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(logs, "probe /healthz from 169.254.7.127:")
	}
	n0 := probes()
	if err := nodeenv.Poll(ctx, "more probes through the SNAT", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		return probes() >= n0+3, nil
	}); err != nil {
		logs, _ := node.Kubectl(ctx, "logs", "-n", ns, "web")
		t.Fatalf("%v; app log:\n%s", err, logs)
	}
	if p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{}); err != nil || !podReady(p) {
		t.Fatalf("pod no longer Ready after probes: %s %v", describe(p), err)
	}

	// Deleted by kubelet: one Del to ztunnel; the netns is gone; containerd's
	// second DEL (empty CNI_NETNS) produced no second Del and no error.
	if err := node.Env.CP.Admin.CoreV1().Pods(ns).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "pod gone from the API, its netns from the node", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			return false, nil
		}
		_, err = os.Stat(netnsPath)
		return os.IsNotExist(err), nil
	}); err != nil {
		t.Fatal(err)
	}
	st = r.waitEmu(t, ctx, "Del for "+uid, func(s ztunnelemu.State) bool {
		_, present := s.Workload(uid)
		return !present && slices.ContainsFunc(s.Requests, func(q ztunnelemu.RequestRecord) bool { return q.UID == uid && q.Op == "del" })
	})
	dels := 0
	for _, q := range st.Requests {
		if q.UID == uid && q.Op == "del" {
			dels++
		}
	}
	if dels != 1 {
		t.Errorf("ztunnel got %d Dels for the pod, want 1", dels)
	}
	if strings.Contains(strings.ToLower(node.Containerd.Logs()), "failed to destroy network") {
		t.Errorf("containerd failed a CNI DEL:\n%s", node.Containerd.LogTail(40))
	}
}

// gatedPodNotReadyWithoutZtunnel: the negative. Without a ztunnel the agent
// cannot enroll (the CNI ADD succeeds, the pod waits `pending`), and a gated
// pod never turns Ready though its container is; once ztunnel is back it is
// enrolled and turns Ready.
func (r *agentRun) gatedPodNotReadyWithoutZtunnel(t *testing.T, ctx context.Context) {
	if err := r.em.Stop(5 * time.Second); err != nil {
		t.Logf("emulator stop: %v", err)
	}
	r.em = nil
	ns := ambientNamespace(t, ctx, "ambient-noztunnel")
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("gated"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := waitPod(ctx, ns, "gated", func(p *corev1.Pod) bool {
		c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
		return p.Status.Phase == corev1.PodRunning && p.Annotations[podmeta.AnnotationRedirection] != "" && c != nil && c.Status == corev1.ConditionFalse
	})
	if err != nil {
		t.Fatal(err)
	}
	if podReady(p) {
		t.Fatalf("gated pod Ready without ztunnel: %s", describe(p))
	}
	if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c != nil && c.Status == corev1.ConditionTrue {
		t.Fatalf("condition %s True without ztunnel: %+v", nodeenv.EnrolledCondition, c)
	}
	t.Logf("without ztunnel: annotation %q; %s", p.Annotations[podmeta.AnnotationRedirection], describe(p))
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := waitPod(ctx, ns, "gated", podReady); err != nil {
		t.Fatal(err)
	}
	t.Logf("ztunnel back -> gated pod Ready: %s", time.Since(start).Round(time.Millisecond))
}
