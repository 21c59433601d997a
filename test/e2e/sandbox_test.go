//go:build e2e

package e2e

// End-to-end tests of "enabled means this sandbox is captured":
// the agent checks the sandbox the pod has now, not the one it remembers —
// a sandbox recreated without our plugin, with the agent running or down; a
// late DEL for an old sandbox; pod annotations parsed as Istio parses them.
// And of the CNI input checks (impossible pod names, paths that are
// not network namespaces).

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// addOf returns the emulator's record of the Add that gave it pod uid in
// the netns with inode ino (the first one), and whether there is one.
func addOf(st ztunnelemu.State, uid string, ino uint64) (ztunnelemu.RequestRecord, bool) {
	for _, r := range st.Requests {
		if r.Op == "add" && r.UID == uid && r.NetnsInode == ino && r.AckError == "" {
			return r, true
		}
	}
	return ztunnelemu.RequestRecord{}, false
}

// condHistory checks the pod versions the watch saw from since on: the
// agent's condition went False before it was True again (unless
// falseOptional), and no True came before captured (the time the new
// sandbox was captured and held by ztunnel). It returns a one-line summary
// for the log and whether a False was seen.
func condHistory(t *testing.T, versions []seenPod, since, captured time.Time, falseOptional bool) (string, bool) {
	t.Helper()
	checkTogether(t, versions)
	var falseAt time.Time
	var steps []string
	for _, s := range versions {
		if s.at.Before(since) {
			continue
		}
		c := enrolledCondition(s.pod)
		if c == nil {
			continue
		}
		step := fmt.Sprintf("%s/%s@+%v", c.Status, c.Reason, s.at.Sub(since).Round(time.Millisecond))
		if len(steps) == 0 || !strings.HasPrefix(steps[len(steps)-1], string(c.Status)+"/"+c.Reason+"@") {
			steps = append(steps, step)
		}
		switch {
		case c.Status == corev1.ConditionFalse && falseAt.IsZero():
			falseAt = s.at
		case c.Status == corev1.ConditionTrue && !falseAt.IsZero() && s.at.Before(captured):
			t.Errorf("condition True (%s) seen %v before the new sandbox was captured and held by ztunnel", c.Reason, captured.Sub(s.at))
		}
	}
	if falseAt.IsZero() && !falseOptional {
		t.Errorf("the condition never went False for the recreated sandbox: a True written for the old sandbox stood for the new, uncaptured one (versions since: %v)", steps)
	}
	return strings.Join(steps, " → "), !falseAt.IsZero()
}

// TestSandboxRecreatedWithoutPlugin: a pod's sandbox
// is recreated through a chain without our plugin (the runtime's conflist
// lost our entry) while the agent runs, with a new address and with the
// same (static) one. Within a verify interval the new netns has our rules,
// its traffic is captured, the emulator holds the new netns, and the
// condition was False from when the agent noticed until then; the probe set
// never pointed at the new sandbox while it was uncaptured.
func TestSandboxRecreatedWithoutPlugin(t *testing.T) {
	for _, sameIP := range []bool{false, true} {
		name := map[bool]string{false: "NewIP", true: "SameIP"}[sameIP]
		t.Run(name, func(t *testing.T) {
			const interval = time.Second
			s := newScenario(t, "sbx", agentEnv(xtablesBackend, "AMBIENTD_VERIFY_INTERVAL="+interval.String()))
			ctx, nsName, em := s.ctx, s.ns, s.em
			pw := watchPods(t, ctx, nsName)
			p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web", Mutate: gated})
			waitAnnotation(t, ctx, p, "enabled")
			want := podRules(t, p)
			oldIP, oldInode := p.IP(), netnsInode(t, p)

			recreated := time.Now()
			if _, err := testEnv.RecreateSandbox(ctx, p, e2eenv.SandboxOptions{Chain: testEnv.PlainChain, SameIP: sameIP}); err != nil {
				t.Fatal(err)
			}
			newInode := netnsInode(t, p)
			if (p.IP() == oldIP) != sameIP || newInode == oldInode {
				t.Fatalf("recreated sandbox: IP %s → %s, netns inode %d → %d", oldIP, p.IP(), oldInode, newInode)
			}
			// Poll the new sandbox until our rules are in it. The probe
			// set is read first, the rules second: an entry for the new
			// address seen while the rules are (still) missing pointed
			// at the uncaptured sandbox.
			var probeEarly string
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			testutil.Until(t, wctx, "our rules in the recreated sandbox", func() bool {
				probe := !sameIP && probeSetHas(t, p.IP())
				rules := podRules(t, p)
				if probe && rules == "" && probeEarly == "" {
					probeEarly = fmt.Sprintf("+%v", time.Since(recreated).Round(time.Millisecond))
				}
				return rules == want
			})
			ruled := time.Since(recreated)
			st := waitEmu(t, wctx, em, "the emulator holding the new netns", func(s ztunnelemu.State) bool {
				w, ok := s.Workload(p.UID)
				return ok && w.NetnsInode == newInode
			})
			add, _ := addOf(st, p.UID, newInode)
			waitPod(t, wctx, p, "condition True again", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
			requireCaptured(t, ctx, em, p, outsideAddr())
			if probeEarly != "" {
				t.Errorf("the probe set held the new address %s at %s while the new sandbox had none of our rules", p.IP(), probeEarly)
			}
			if !sameIP && !probeSetHas(t, p.IP()) {
				t.Errorf("probe set lacks the re-enrolled pod's new address %s", p.IP())
			}
			if !sameIP && probeSetHas(t, oldIP) {
				t.Errorf("probe set still holds the old sandbox's address %s", oldIP)
			}
			hist, _ := condHistory(t, pw.of(p.Name), recreated, add.At, false)
			t.Logf("sandbox recreated without our plugin (%s): rules in the new netns after %v, ztunnel Add %v after (verify interval %v); condition: %s",
				name, ruled.Round(time.Millisecond), add.At.Sub(recreated).Round(time.Millisecond), interval, hist)
		})
	}
}

// TestSandboxRecreatedWhileAgentDown (Must show 2): the sandbox is recreated
// without our plugin while the agent is down; the restarted agent must not
// trust the True written for the old sandbox: the condition goes False and
// is True again only once the new sandbox is captured and held by ztunnel.
// With the state file (it names the old, vanished netns) and without it
// (then the kubelet's PodReadyToStartContainers, newer than the agent's
// True, tells the sandbox changed).
//
// The False may be skipped in one case only: the restarted agent had
// already put our rules into the new sandbox when it began serving (it
// re-enrolls restored pods before that), and re-enrolled it before its
// status writer got to the False, which the True then supersedes. The
// stale True then stood only while no agent ran. An agent that served
// with the new sandbox uncaptured and never wrote the False fails.
func TestSandboxRecreatedWhileAgentDown(t *testing.T) {
	for _, keepState := range []bool{true, false} {
		name := map[bool]string{true: "StateFile", false: "NoStateFile"}[keepState]
		t.Run(name, func(t *testing.T) {
			s := newScenario(t, "sbxdown", agentEnv(xtablesBackend))
			ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
			pw := watchPods(t, ctx, nsName)
			p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web", Mutate: gated})
			o := waitPod(t, ctx, p, "condition True", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
			want := podRules(t, p)
			// The API keeps condition times to the second: recreate the
			// sandbox in a later second than the agent's True, as any
			// real recreation is.
			trueSince := enrolledCondition(o).LastTransitionTime.Time
			testutil.Until(t, ctx, "a later second than the True", func() bool { return time.Now().Truncate(time.Second).After(trueSince) })

			if err := a.Kill(); err != nil {
				t.Fatal(err)
			}
			if _, err := testEnv.RecreateSandbox(ctx, p, e2eenv.SandboxOptions{Chain: testEnv.PlainChain}); err != nil {
				t.Fatal(err)
			}
			newInode := netnsInode(t, p)
			if !keepState {
				if err := os.Remove(filepath.Join(testEnv.AgentRunDir, "pods.json")); err != nil && !os.IsNotExist(err) {
					t.Fatal(err)
				}
			}
			restarted := time.Now()
			if err := a.Start(); err != nil {
				t.Fatal(err)
			}
			waitCNIServing(t, ctx)
			ruledWhenServing := podRules(t, p) == want
			wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			st := waitEmu(t, wctx, em, "the emulator holding the new netns", func(s ztunnelemu.State) bool {
				w, ok := s.Workload(p.UID)
				return ok && w.NetnsInode == newInode
			})
			add, _ := addOf(st, p.UID, newInode)
			waitPod(t, wctx, p, "condition True again", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
			if got := podRules(t, p); got != want {
				t.Errorf("rules in the new sandbox after the restart:\n%s\nwant:\n%s", got, want)
			}
			requireCaptured(t, ctx, em, p, outsideAddr())
			hist, sawFalse := condHistory(t, pw.of(p.Name), restarted, add.At, true)
			if !sawFalse && !ruledWhenServing {
				t.Errorf("the condition never went False for the recreated sandbox and the restarted agent served before its rules were in it: a True written for the old sandbox stood for the new, uncaptured one (condition since the restart: %s)", hist)
			}
			t.Logf("sandbox recreated while the agent was down (%s): condition after the restart: %s", name, hist)
		})
	}
}

// TestLateDelOfVanishedOldSandbox (Must show 6): the pod's sandbox is
// recreated through the full chain (the agent enrolls the new one); the
// runtime then removes the old sandbox, netns first, and its DEL names a
// netns path that no longer exists. The live sandbox stays enrolled: no Del
// reaches ztunnel, the pod stays enabled and captured.
func TestLateDelOfVanishedOldSandbox(t *testing.T) {
	s := newScenario(t, "latedel")
	ctx, nsName, em := s.ctx, s.ns, s.em
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web"})
	waitAnnotation(t, ctx, p, "enabled")
	old, err := testEnv.RecreateSandbox(ctx, p, e2eenv.SandboxOptions{KeepOld: true})
	if err != nil {
		t.Fatal(err)
	}
	newInode := netnsInode(t, p)
	st := waitEmu(t, ctx, em, "the emulator holding the new sandbox", func(s ztunnelemu.State) bool {
		w, ok := s.Workload(p.UID)
		return ok && w.NetnsInode == newInode
	})
	dels := countOps(st, "del", p.UID)
	if err := testEnv.TeardownSandbox(ctx, old, nil, true); err != nil {
		t.Fatal(err)
	}
	// The DEL is answered after the agent acted on it: what it sent
	// ztunnel is recorded by now.
	st = emuState(t, ctx, em)
	if n := countOps(st, "del", p.UID); n != dels {
		t.Errorf("the late DEL of the old sandbox (netns %s, gone) sent ztunnel %d Del(s) for the live pod", old.NetnsPath, n-dels)
	}
	if w, ok := st.Workload(p.UID); !ok || w.NetnsInode != newInode {
		t.Errorf("after the late DEL the emulator holds the pod: %v %+v, want netns inode %d", ok, w, newInode)
	}
	if v, _ := annotationOf(t, ctx, p); v != "enabled" {
		t.Errorf("annotation %q after the late DEL, want enabled", v)
	}
	requireCaptured(t, ctx, em, p, outsideAddr())
}

// TestAnnotationsParsedLikeIstio (Must show 5): boolean annotations take
// what strconv.ParseBool takes (Istio's rule), so "True" and "1" enroll; an
// enrolled pod whose annotation turns invalid is still verified, against the
// options it was enrolled with, so rules flushed afterwards are repaired;
// "+" (every interface, for iptables) is not an interface name.
func TestAnnotationsParsedLikeIstio(t *testing.T) {
	s := newScenario(t, "ann", within(5*time.Minute), agentEnv(xtablesBackend, "AMBIENTD_VERIFY_INTERVAL=1s"))
	ctx, nsName, em := s.ctx, s.ns, s.em

	t.Run("TrueAccepted", func(t *testing.T) {
		p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: "capital", Annotations: map[string]string{
			annDNSCapture: "True", "ambient.istio.io/bypass-inbound-capture": "1"}})
		if err != nil {
			t.Fatalf("pod with %s=True, bypass-inbound-capture=1: %v", annDNSCapture, err)
		}
		t.Cleanup(func() { _ = testEnv.DeletePod(context.Background(), p) })
		waitAnnotation(t, ctx, p, "enabled")
		rules := podRules(t, p)
		if !strings.Contains(rules, "15053") || strings.Contains(rules, "15006") {
			t.Errorf("rules of a pod with DNS capture True and inbound bypass 1 (want a 15053 redirect, no 15006 one):\n%s", rules)
		}
		requireCaptured(t, ctx, em, p, outsideAddr())
	})

	t.Run("InvalidLaterStillVerified", func(t *testing.T) {
		p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "turns", Annotations: map[string]string{annDNSCapture: "false"}})
		waitAnnotation(t, ctx, p, "enabled")
		want := podRules(t, p)
		if strings.Contains(want, "15053") {
			t.Fatalf("dns-capture=false pod has DNS capture:\n%s", want)
		}
		patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"maybe"}}}`, annDNSCapture)
		if _, err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		wipeRules(t, p)
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		testutil.Until(t, wctx, "the flushed rules repaired with the options the pod was enrolled with", func() bool { return podRules(t, p) == want })
		for _, e := range podEvents(t, ctx, p, agent.EventInvalidAnnotation) {
			if e.Type != corev1.EventTypeWarning || !strings.Contains(e.Message, annDNSCapture) || !strings.Contains(e.Message, "maybe") {
				t.Errorf("InvalidAnnotation Event %s %q: want a Warning naming the annotation and the value", e.Type, e.Message)
			}
		}
		if v, _ := annotationOf(t, ctx, p); v != "enabled" {
			t.Errorf("annotation %q, want enabled", v)
		}
		requireCaptured(t, ctx, em, p, outsideAddr())
	})

	t.Run("PlusIsNoInterface", func(t *testing.T) {
		p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: "plus", Annotations: map[string]string{
			"istio.io/reroute-virtual-interfaces": "+"}})
		if err == nil {
			t.Cleanup(func() { _ = testEnv.DeletePod(context.Background(), p) })
			t.Fatalf("pod with reroute-virtual-interfaces=+ started (rules:\n%s)", podRules(t, p))
		}
		if !strings.Contains(err.Error(), "reroute-virtual-interfaces") {
			t.Errorf("CNI ADD error does not name the annotation: %v", err)
		}
	})
}

// TestCNIAddImpossibleInput: a CNI ADD whose pod name can
// never be a pod's, and netns paths that are not network namespaces (a
// regular file, a FIFO that would block an open), are refused at once —
// long before the pod lookup's timeout — and the agent keeps nothing open.
func TestCNIAddImpossibleInput(t *testing.T) {
	s := newScenario(t, "impossible", within(3*time.Minute))
	ctx, nsName, a := s.ctx, s.ns, s.agent
	real := createObjectOnly(t, ctx, nsName, "real")
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	ghostNS, err := e2eenv.NewNetns(filepath.Join(testEnv.Dir, "netns"), nsName+"_dots")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e2eenv.DeleteNetns(ghostNS) })

	dots := real.DeepCopy()
	dots.Name = "../../etc"
	for _, c := range []struct {
		name  string
		pod   *corev1.Pod
		netns string
		want  string
	}{
		{"pod name ../../etc", dots, ghostNS.Path(), "../../etc"},
		{"netns /etc/passwd", real, "/etc/passwd", "/etc/passwd"},
		{"netns a FIFO", real, fifo, fifo},
	} {
		t.Run(strings.ReplaceAll(c.name, "/", "_"), func(t *testing.T) {
			cctx, cancel := context.WithTimeout(ctx, 40*time.Second)
			defer cancel()
			start := time.Now()
			out, err := runPluginAdd(cctx, c.pod, c.netns)
			took := time.Since(start)
			t.Logf("%s: refused after %v: %v %s", c.name, took.Round(time.Millisecond), err, strings.TrimSpace(out))
			if err == nil || !strings.Contains(out, c.want) {
				t.Errorf("CNI ADD: err %v, output %s; want a refusal naming %q", err, out, c.want)
			}
			if took > 5*time.Second {
				t.Errorf("refused after %v: want at once, not after a lookup or an open that waits (lookup timeout 10s)", took)
			}
		})
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", a.Pid()))
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", a.Pid(), fd.Name()))
		if slices.Contains([]string{fifo, "/etc/passwd"}, target) {
			t.Errorf("agent holds %s open (fd %s)", target, fd.Name())
		}
	}
}

// TestProbeEntryFollowsRules: the one probe
// rule — a pod's IPs are in the node's probe set exactly while our rules are
// in its sandbox. A pod pending at start (no ztunnel yet) already has its
// kubelet probes SNATed past the capture (a liveness probe must not kill it
// during a long ztunnel outage; readiness is held by the condition). An
// enabled pod that a new ztunnel refuses in its snapshot goes pending with
// the condition False in one write and keeps its probe entry (its rules
// stay), and is enabled again once accepted.
func TestProbeEntryFollowsRules(t *testing.T) {
	s := newScenario(t, "probe", withoutZtunnel(), agentEnv(xtablesBackend, "AMBIENTD_RETRY_MAX_DELAY=1s"))
	ctx, nsName := s.ctx, s.ns
	pw := watchPods(t, ctx, nsName)
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web", Mutate: gated})
	waitPod(t, ctx, p, "pending without ztunnel", podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelUnavailable))
	if src, err := probeSource(ctx, p); err != nil || src.String() != "169.254.7.127" {
		t.Errorf("kubelet-like probe of a pending pod: source %v, %v; want SNATed to 169.254.7.127 (the probe entry goes in with the rules)", src, err)
	}

	first := startEmulator(t, ctx, "ztunnel-probe-1")
	waitPod(t, ctx, p, "enabled", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
	if err := first.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	refusing, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: "ztunnel-probe-2", Args: []string{"--nack=" + nsName + "/web=refused by the test"}})
	if err != nil {
		t.Fatal(err)
	}
	refusing.LogOnFailure(t)
	t.Cleanup(func() { _ = refusing.Stop(10 * time.Second) })
	o := waitPod(t, ctx, p, "pending after the snapshot refusal", podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelRejected))
	if o.Annotations[annRedirect] != "pending" || kubeletWouldBeReady(o) {
		t.Errorf("refused pod: annotation %q, would be Ready %v; want pending, not Ready", o.Annotations[annRedirect], kubeletWouldBeReady(o))
	}
	if !probeSetHas(t, p.IP()) {
		t.Errorf("the refused pod lost its probe entry though its rules are in place")
	}
	if src, err := probeSource(ctx, p); err != nil || src.String() != "169.254.7.127" {
		t.Errorf("kubelet-like probe of the refused pod: %v, %v; want SNATed (liveness passes, readiness held by the condition)", src, err)
	}
	if err := refusing.ClearNack(ctx, nsName+"/web"); err != nil {
		t.Fatal(err)
	}
	waitPod(t, ctx, p, "enabled again", podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled))
	if !probeSetHas(t, p.IP()) {
		t.Errorf("re-enabled pod has no probe entry")
	}
	checkTogether(t, pw.of(p.Name))
}
