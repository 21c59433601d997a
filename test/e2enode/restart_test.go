//go:build e2enode

package e2enode

import (
	"context"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// containersRestartStayEnrolled: containers restart inside the sandbox they
// have — one container after it crashed, and all of the pod's containers in
// place (a restartPolicyRules RestartAllContainers action, KEP-5532, on by
// default in this kubelet) — with no new CNI ADD: the network namespace and
// its rules stay, so must the enrollment: ztunnel gets no Del and no Add,
// the pod ends Ready, enabled, its condition True, its traffic captured.
func (r *agentRun) containersRestartStayEnrolled(t *testing.T, ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	ns := ambientNamespace(t, ctx, "ambient-restarts")
	pod := nodeenv.GatedPod("web")
	always := corev1.ContainerRestartPolicyAlways
	app := &pod.Spec.Containers[0]
	app.RestartPolicy = &always
	app.RestartPolicyRules = []corev1.ContainerRestartRule{{
		Action:    corev1.ContainerRestartRuleActionRestartAllContainers,
		ExitCodes: &corev1.ContainerRestartRuleOnExitCodes{Operator: corev1.ContainerRestartRuleOnExitCodesOpIn, Values: []int32{137}}, // SIGKILL
	}}
	// A second container: RestartAllContainers restarts it too, a single
	// container's restart does not.
	pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{Name: "second", Image: nodeenv.PauseImage, ImagePullPolicy: corev1.PullNever})
	created, netnsPath := startPod(t, ctx, ns, pod)
	uid := string(created.UID)
	ino := inode(t, netnsPath)
	st := r.waitEmu(t, ctx, "workload "+uid, func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	ops := opsFor(st, uid)

	restartsOf := func(p *corev1.Pod, name string) int32 {
		for _, s := range p.Status.ContainerStatuses {
			if s.Name == name {
				return s.RestartCount
			}
		}
		return -1
	}
	for _, c := range []struct {
		what       string
		sig        syscall.Signal
		allRestart bool
	}{
		{"the app container restarted (SIGTERM: its own restart policy)", syscall.SIGTERM, false},
		{"all containers restarted in place (SIGKILL: RestartAllContainers)", syscall.SIGKILL, true},
	} {
		p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		restarts, second := restartsOf(p, "app"), restartsOf(p, "second")
		killed := time.Now()
		if err := syscall.Kill(processIn(t, ino, "httpapp"), c.sig); err != nil {
			t.Fatal(err)
		}
		p, err = waitPod(ctx, ns, "web", func(p *corev1.Pod) bool {
			return restartsOf(p, "app") > restarts && (!c.allRestart || restartsOf(p, "second") > second) && podReady(p)
		})
		if err != nil {
			t.Fatalf("%s: %v; %s", c.what, err, describe(p))
		}
		if !c.allRestart && restartsOf(p, "second") != second {
			t.Errorf("%s: the second container restarted too", c.what)
		}
		t.Logf("%s -> Ready again: %s", c.what, time.Since(killed).Round(time.Millisecond))
		if now, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP)); err != nil || inode(t, now) != ino {
			t.Fatalf("%s: the pod's netns changed (%s, %v): not the case this step is about", c.what, now, err)
		}
		if cond := nodeenv.Condition(p, nodeenv.EnrolledCondition); p.Annotations[podmeta.AnnotationRedirection] != "enabled" || cond == nil || cond.Status != corev1.ConditionTrue {
			t.Errorf("%s: annotation %q, condition %+v; want enabled and True", c.what, p.Annotations[podmeta.AnnotationRedirection], cond)
		}
		if err := r.em.State(ctx, &st); err != nil {
			t.Fatal(err)
		}
		if now := opsFor(st, uid); !slices.Equal(now, ops) {
			t.Errorf("%s: ztunnel requests for the pod went from %v to %v", c.what, ops, now)
		}
		if w, ok := st.Workload(uid); !ok || w.NetnsInode != ino {
			t.Errorf("%s: ztunnel holds the pod %v with netns inode %d, want %d", c.what, ok, w.NetnsInode, ino)
		}
		dst := netip.AddrPortFrom(node.IP, 9).String()
		accepted := len(st.Accepted)
		dialFrom(t, ctx, netnsPath, dst)
		r.waitEmu(t, ctx, c.what+": outbound still captured", func(s ztunnelemu.State) bool {
			return slices.ContainsFunc(s.Accepted[accepted:], func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
		})
	}
}
