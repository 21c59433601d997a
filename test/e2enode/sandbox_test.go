//go:build e2enode

package e2enode

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// sandboxRecreatedStaysEnrolled: the pod's sandbox dies (its pause process
// is killed); kubelet stops it (CNI DEL with its netns), starts a new one
// (ADD with a new netns) and, in its garbage collection about a minute
// later, removes the dead one, for which containerd 1.6 runs CNI DEL again
// with an empty CNI_NETNS and the old sandbox's id but the same pod uid.
// The pod must end enrolled with the new netns, and stay so after that late
// DEL: no Del to ztunnel after the last Add.
func (r *agentRun) sandboxRecreatedStaysEnrolled(t *testing.T, ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	ns := ambientNamespace(t, ctx, "ambient-retry")
	created, oldNetns := startPod(t, ctx, ns, nodeenv.GatedPod("web"))
	uid := string(created.UID)
	oldInode := inode(t, oldNetns)
	pause := processIn(t, oldInode, "pause")
	var st0 ztunnelemu.State
	if err := r.em.State(ctx, &st0); err != nil {
		t.Fatal(err)
	}
	n0 := len(opsFor(st0, uid))
	killed := time.Now()
	if err := unixKill(pause); err != nil {
		t.Fatal(err)
	}
	// A new sandbox: ztunnel gets a Del and an Add again (with the new netns:
	// compared below by the path containerd made, since the kernel may give
	// the new netns the dead one's inode number), the pod Ready again.
	r.waitEmu(t, ctx, "Del and a new Add", func(s ztunnelemu.State) bool {
		ops := opsFor(s, uid)
		return len(ops) >= n0+2 && slices.Contains(ops[n0:], "del") && ops[len(ops)-1] == "add"
	})
	// Ready again in a new sandbox: the pod's reported IP is in a netns
	// that is not the old one (the status may still show the old IP for a
	// moment).
	var p *corev1.Pod
	var newNetns string
	if err := nodeenv.Poll(ctx, "pod Ready in its new sandbox", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		var err error
		if p, err = node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{}); err != nil || !podReady(p) {
			return false, err
		}
		newNetns, err = node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
		return err == nil && newNetns != oldNetns, err
	}); err != nil {
		t.Fatalf("%v; %s", err, describe(p))
	}
	t.Logf("pause killed -> pod Ready in a new sandbox: %s", time.Since(killed).Round(time.Millisecond))
	newInode := inode(t, newNetns)
	st := r.waitEmu(t, ctx, "the pod held with its new netns", func(s ztunnelemu.State) bool {
		w, ok := s.Workload(uid)
		return ok && w.NetnsInode == newInode
	})
	t.Logf("sandbox recreated: netns %s (inode %d) -> %s (inode %d); requests for the pod: %s", oldNetns, oldInode, newNetns, newInode, opsFor(st, uid))
	// kubelet's garbage collection removes a dead sandbox with
	// RemovePodSandbox once it holds no containers (with the default dead
	// container retention that is when the pod goes); make that same CRI call
	// now. containerd 1.6 then runs CNI DEL for the old sandbox again, with
	// an empty CNI_NETNS and the pod's uid.
	opsBefore := opsFor(st, uid)
	removeDeadSandboxes(t, ctx, uid)
	// The CNI DEL ran synchronously inside RemovePodSandbox, so the agent
	// answered it already.
	st = ztunnelemu.State{}
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	w, ok := st.Workload(uid)
	if !ok || w.NetnsInode != newInode {
		t.Errorf("after kubelet removed the dead sandbox, ztunnel has the pod: %v (%+v), want it with netns inode %d; requests: %s", ok, w, newInode, opsFor(st, uid))
	}
	// The agent answers a DEL after it told ztunnel, so a Del it sent for
	// this one is recorded by now.
	if ops := opsFor(st, uid); len(ops) != len(opsBefore) {
		t.Errorf("the dead sandbox's late DEL reached ztunnel: requests for the pod went from %v to %v (a live pod dropped and re-added)", opsBefore, ops)
	}
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("pod after the late DEL: %s, annotation %q (%v)", describe(p), p.Annotations[podmeta.AnnotationRedirection], err)
	}
}
