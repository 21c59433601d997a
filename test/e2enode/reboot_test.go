//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// nodeRebootCapturesBeforeReady: the node loses power with ambient pods and a
// plain pod running, then boots (nodeenv PowerOff/PowerOn: kubelet,
// containerd, every container and the agent killed; netns, /run, firewall and
// bridge gone; the control plane keeps the pods, their `enabled` annotations
// and True enrolled conditions). At boot, before kubelet starts anything (the
// agent included), the primary CNI's installer writes its conflist again from
// its template, as Calico's install-cni, flannel's init container and Cilium
// do: a chained entry in that file is gone. ztunnel comes back only after the
// agent and the pods' new sandboxes. With the DaemonSet's default settings,
// every ambient pod must be captured again — the CNI ADD of its new sandbox
// reaches the agent and ztunnel gets its new netns — before its app starts
// and before it turns Ready; none turns Ready while ztunnel is away; the
// config the runtime uses carries the primary's boot-time rewrite and our
// plugin; the plain pod comes back untouched.
func (r *agentRun) nodeRebootCapturesBeforeReady(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-reboot")
	plainNs := namespace(t, ctx, "plain-reboot")
	names := []string{"a", "b", "c"}
	oldIPs := map[string]string{}
	for _, name := range names {
		if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod(name), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	plain, err := node.Env.CP.Admin.CoreV1().Pods(plainNs).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "plain"}, Spec: appPodSpec()}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := waitPod(ctx, plainNs, "plain", podReady); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool {
			return podReady(p) && p.Annotations[podmeta.AnnotationRedirection] == "enabled"
		})
		if err != nil {
			t.Fatal(err)
		}
		oldIPs[name] = p.Status.PodIP
	}

	// A pod that turns Ready after the reboot must be held by ztunnel with
	// its running netns right then: ztunnel's state only grows between that
	// moment and this check, so a miss here is a real miss.
	var emu atomic.Pointer[e2eenv.Emulator]
	var violations []string
	var vmu sync.Mutex
	defer func() { // also when a check below stops the test
		vmu.Lock()
		defer vmu.Unlock()
		for _, v := range violations {
			t.Error(v)
		}
	}()
	rw := watchReady(t, ctx, ns, func(p *corev1.Pod) {
		em := emu.Load()
		var msg string
		if em == nil {
			msg = fmt.Sprintf("pod %s Ready after the reboot while no ztunnel runs", p.Name)
		} else {
			var st ztunnelemu.State
			if err := em.State(ctx, &st); err != nil {
				msg = fmt.Sprintf("emulator state at pod %s Ready: %v", p.Name, err)
			} else if w, ok := st.Workload(string(p.UID)); !ok {
				msg = fmt.Sprintf("pod %s Ready after the reboot, ztunnel does not hold it (requests %v)", p.Name, opsFor(st, string(p.UID)))
			} else if path, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP)); err != nil || inodeOf(path) != w.NetnsInode {
				msg = fmt.Sprintf("pod %s Ready after the reboot, ztunnel holds netns inode %d, the pod runs in %s (%v)", p.Name, w.NetnsInode, path, err)
			}
		}
		if msg != "" {
			vmu.Lock()
			violations = append(violations, msg)
			vmu.Unlock()
		}
	})

	if err := r.em.Stop(5 * time.Second); err != nil {
		t.Logf("emulator stop: %v", err)
	}
	r.em = nil
	off := time.Now()
	if err := node.PowerOff(ctx); err != nil {
		// Boot anyway, so the node is usable for the cleanup and later tests.
		t.Errorf("power off: %v", err)
		if err := node.PowerOn(ctx); err != nil {
			t.Errorf("power on: %v", err)
		}
		t.FailNow()
	}
	t.Logf("power off: %s", time.Since(off).Round(time.Millisecond))
	bootMark := fmt.Sprintf("boot-%d", time.Now().UnixNano())
	if _, err := node.PrimaryCNIBoot(bootMark); err != nil {
		t.Fatalf("primary CNI installer at boot: %v", err)
	}
	t.Logf("primary CNI installer at boot rewrote %s from its template (%s); the runtime's config now: %s", nodeenv.Conflist, bootMark, runtimeConfig(t))
	// The primary's file is the primary's: what an uninstall must leave
	// byte for byte is now this rewrite (the agent's default mode never
	// edits it; UninstallLeavesNodeAsBefore checks against it).
	r.pristine.primaryRewrote(t)
	on := time.Now()
	if err := node.PowerOn(ctx); err != nil {
		t.Fatalf("power on: %v", err)
	}
	t.Logf("power on -> containerd and kubelet answering: %s", time.Since(on).Round(time.Millisecond))

	// Without ztunnel: the agent comes back (not ready), the ambient pods get
	// new sandboxes with the redirection in place and wait `pending`.
	if err := nodeenv.Poll(ctx, "agent answering /readyz after the reboot, ambient pods running again and pending", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		code, body, err := nodeenv.AgentReadyz(ctx)
		if err != nil {
			return false, err
		}
		if code == http.StatusOK {
			return false, fmt.Errorf("agent ready without a ztunnel: %s", body)
		}
		for _, name := range names {
			p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if !containerStartedSince(p, on) || p.Annotations[podmeta.AnnotationRedirection] != "pending" {
				return false, fmt.Errorf("pod %s: annotation %q; %s", name, p.Annotations[podmeta.AnnotationRedirection], describe(p))
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("power on -> agent back, ambient pods running and pending (no ztunnel): %s", time.Since(on).Round(time.Millisecond))
	for _, name := range names {
		p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if podReady(p) {
			t.Errorf("pod %s Ready after the reboot without ztunnel: %s", name, describe(p))
		}
		// Its new sandbox ran through our plugin, despite the primary's
		// rewrite at boot: the redirection was in place before its app
		// started.
		startedCaptured(t, ctx, p)
	}
	if t.Failed() {
		t.FailNow()
	}
	// kubelet probes them meanwhile, and its probes reach the apps: a
	// pending pod's probe entry goes in with its rules (docs/readiness.md,
	// "one rule"), so its containers turn ready (liveness would pass too:
	// no restart loop during a long ztunnel outage) — and still no pod is
	// Ready: the readiness gate holds it (the watch above records any).
	if err := nodeenv.Poll(ctx, "kubelet's probes of every pending ambient pod passing (ContainersReady) after the reboot", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		for _, name := range names {
			p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			c := nodeenv.Condition(p, corev1.ContainersReady)
			if c == nil || c.Status != corev1.ConditionTrue || !containerStartedSince(p, on) || p.Annotations[podmeta.AnnotationRedirection] != "pending" {
				return false, fmt.Errorf("pod %s: %s", name, describe(p))
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); err != nil || podReady(p) {
			t.Errorf("pod %s Ready (or unreadable: %v) while pending without ztunnel", name, err)
		}
	}
	t.Logf("power on -> kubelet's probes of every pending pod pass through the probe SNAT, none Ready: %s", time.Since(on).Round(time.Millisecond))

	em, err := node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	emu.Store(em)
	r.em = em
	ztStart := time.Now()
	for _, name := range names {
		p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool { return podReady(p) && !rw.ready(name).IsZero() })
		if err != nil {
			t.Fatal(err)
		}
		if p.Status.PodIP == oldIPs[name] {
			t.Logf("pod %s kept its IP %s", name, p.Status.PodIP)
		}
		if got := p.Annotations[podmeta.AnnotationRedirection]; got != "enabled" {
			t.Errorf("pod %s after the reboot: annotation %q, want enabled", name, got)
		}
		if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c == nil || c.Status != corev1.ConditionTrue {
			t.Errorf("pod %s after the reboot: condition %+v, want True", name, c)
		}
		add := r.capturedBeforeStart(t, ctx, p)
		t.Logf("pod %s: ztunnel back -> Add %s, -> Ready %s (power on -> Ready %s)", name,
			add.At.Sub(ztStart).Round(time.Millisecond), rw.ready(name).Sub(ztStart).Round(time.Millisecond), rw.ready(name).Sub(on).Round(time.Millisecond))
	}
	// The primary's boot-time rewrite reached the config the runtime uses,
	// with our plugin last.
	if _, text, err := node.RuntimeConfig(); err != nil || !strings.Contains(text, bootMark) || !strings.Contains(text, `"ambientd-cni"`) {
		t.Errorf("after the reboot the runtime's CNI config lacks the primary's rewrite %s or our plugin (%v): %s", bootMark, err, runtimeConfig(t))
	}

	// The plain pod is back, not enrolled, never handed to ztunnel.
	p, err := waitPod(ctx, plainNs, "plain", func(p *corev1.Pod) bool { return podReady(p) && containerStartedSince(p, on) })
	if err != nil {
		t.Fatal(err)
	}
	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	if ops := opsFor(st, string(plain.UID)); len(ops) != 0 || p.Annotations[podmeta.AnnotationRedirection] != "" {
		t.Errorf("plain pod after the reboot: ztunnel requests %v, annotation %q", ops, p.Annotations[podmeta.AnnotationRedirection])
	}
}
