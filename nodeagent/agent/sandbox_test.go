package agent

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// conditioned gives p the agent's condition True since ours and kubelet's
// PodReadyToStartContainers since sandbox, as the API would show them.
func conditioned(p *corev1.Pod, ours, sandbox time.Time) *corev1.Pod {
	p.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue, LastTransitionTime: metav1.NewTime(sandbox)},
		{Type: podmeta.ConditionEnrolled, Status: corev1.ConditionTrue, Reason: ReasonEnrolled, LastTransitionTime: metav1.NewTime(ours)},
	}
	return p
}

// writeState records uid's netns at path in a state file under a new run
// dir, and returns the dir.
func writeState(t *testing.T, records map[string]string) string {
	t.Helper()
	runDir := t.TempDir()
	st, err := podnetns.OpenState(filepath.Join(runDir, "pods.json"))
	if err != nil {
		t.Fatal(err)
	}
	for uid, path := range records {
		h, err := podnetns.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Put(uid, h, iptables.PodOptions{}); err != nil {
			t.Fatal(err)
		}
		h.Close()
	}
	return runDir
}

// A DEL of a pod that still exists: ztunnel is told, the probe entry goes,
// and the pod stays registered, uncaptured — pending with the condition
// False ("sandbox gone, waiting for re-enrollment") — until its next
// sandbox's ADD enrolls it there.
func TestCNIDelOfLivePodWaitsForReenrollment(t *testing.T) {
	next := testutil.NewNetNS(t)
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withRealNetns(), withConfig(func(c *Config) { c.RetryBaseDelay, c.RetryMaxDelay = time.Hour, time.Hour }), withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	h.waitFor("pod in the cache", func() bool { return h.agent.podByUID("uid-a") != nil })
	if err := h.cni.HandleDel(t.Context(), PodEvent{Namespace: "app", Name: "a", UID: "uid-a", NetnsPath: h.podNetns}); err != nil {
		t.Fatal(err)
	}
	if st := h.state("uid-a"); st != "uncaptured" {
		t.Fatalf("after the DEL of a live pod: %s, want uncaptured", st)
	}
	if !h.zt.deleted("uid-a") {
		t.Error("ztunnel not told to drop the deleted sandbox")
	}
	if _, _, probes := h.rules.counts(); probes != 0 {
		t.Error("probe entry kept for a deleted sandbox")
	}
	// A ztunnel connecting now must not be told to keep it: ztunnel was
	// told to drop it, and its sandbox is gone.
	for _, e := range h.agent.Snapshot() {
		if e.Workload.UID == "uid-a" {
			t.Errorf("uncaptured pod in a new ztunnel's snapshot: %+v", e)
		}
	}
	h.waitFor("pending, condition False/SandboxChanged", func() bool {
		v, _ := h.annotation("app", "a")
		c := h.condition("app", "a")
		return v == "pending" && c != nil && c.Status == corev1.ConditionFalse && c.Reason == ReasonSandboxChanged
	})
	// The next sandbox's ADD.
	ev := h.event(p)
	ev.NetnsPath = next.NS.Path()
	if out, err := h.cni.HandleAdd(t.Context(), ev); err != nil || out != Enrolled {
		t.Fatalf("ADD of the next sandbox: %v, %v", out, err)
	}
	if e, _ := h.reg.Get("uid-a"); e.Phase != registry.Enabled || e.Netns.Inode() != next.Inode {
		t.Errorf("after the next ADD: %v in %v, want enabled in inode %d", e.Phase, e.Netns, next.Inode)
	}
	h.waitFor("annotation enabled again", func() bool { v, _ := h.annotation("app", "a"); return v == "enabled" })
}

// The ztunnel re-add goes through the pod's sync: an enabled pod gets a
// fresh Add and the result is reported; a pod released meanwhile gets no
// Add after its Del (one writer of what ztunnel carries).
func TestReaddThroughThePodSync(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	adds := h.zt.added("uid-a")
	reported := make(chan error, 2)
	h.agent.Readd("uid-a", func(err error) { reported <- err })
	select {
	case err := <-reported:
		if err != nil {
			t.Fatalf("re-add reported %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("re-add never reported")
	}
	if h.zt.added("uid-a") != adds+1 || h.state("uid-a") != "enabled" {
		t.Errorf("after the re-add: %d Adds (want %d), state %s", h.zt.added("uid-a"), adds+1, h.state("uid-a"))
	}

	if err := h.client.CoreV1().Pods("app").Delete(t.Context(), "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("pod released", func() bool { return h.state("uid-a") == "absent" && h.zt.deleted("uid-a") })
	adds = h.zt.added("uid-a")
	h.agent.Readd("uid-a", func(err error) { reported <- err })
	if _, err := h.agent.sync(t.Context(), "uid-a", nil); err != nil {
		t.Fatal(err)
	}
	if n := h.zt.added("uid-a"); n != adds {
		t.Errorf("a re-add after the release's Del sent %d Add(s)", n-adds)
	}
}

// A restart trusts an `enabled` pod's True only for the sandbox it was
// written for: without a state record, a True older than kubelet's
// PodReadyToStartContainers is not trusted (pending, re-enrolled); a newer
// one is.
func TestRestartDistrustsTrueOlderThanSandbox(t *testing.T) {
	for _, c := range []struct {
		name          string
		ours, sandbox time.Time
		want          string
	}{
		{"True older than the sandbox", time.Unix(1000, 0), time.Unix(1010, 0), "pending"},
		{"True newer than the sandbox", time.Unix(1010, 0), time.Unix(1000, 0), "enabled"},
	} {
		t.Run(c.name, func(t *testing.T) {
			hostProc := t.TempDir()
			podNS := testutil.NewNetNS(t)
			fakeSandbox(t, hostProc, 100, "uid-a", podNS.NS.Path())
			p := conditioned(runningPod(pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "127.0.0.1"), c.ours, c.sandbox)
			h := newHarness(t, withConfig(func(cfg *Config) { cfg.HostProc = hostProc }), withObjects(namespace("app", true), p))
			if st := h.state("uid-a"); st != c.want {
				t.Fatalf("restored as %s, want %s", st, c.want)
			}
			if c.want == "pending" {
				// False (SandboxChanged, or ZtunnelUnavailable once
				// its re-Add found no ztunnel) before True again.
				h.waitFor("pending and False written", func() bool {
					v, _ := h.annotation("app", "a")
					cond := h.condition("app", "a")
					return v == "pending" && cond != nil && cond.Status == corev1.ConditionFalse
				})
			}
			h.zt.connect()
			h.waitFor("enabled", func() bool { v, _ := h.annotation("app", "a"); return h.state("uid-a") == "enabled" && v == "enabled" })
		})
	}
}

// The state file's netns is accepted only when it still holds one of the
// pod's IPs (inode numbers are reused): a record naming a netns without the
// pod's IP is not its sandbox. Here the record names an old sandbox and the
// /proc scan finds the new one: the pod's enabled is not trusted (the
// sandbox changed while the agent was down). Records of pods gone while the
// agent was down are dropped.
func TestRestartStateRecordOfAnotherSandbox(t *testing.T) {
	hostProc := t.TempDir()
	oldNS := testutil.NewNetNS(t) // holds 127.0.0.1 only
	newNS := netnsWith(t, "10.1.0.9")
	runDir := writeState(t, map[string]string{"uid-a": oldNS.NS.Path(), "uid-gone": oldNS.NS.Path()})
	fakeSandbox(t, hostProc, 100, "uid-a", newNS.NS.Path())
	p := runningPod(pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "10.1.0.9")
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc, c.RunDir = hostProc, runDir }), withObjects(namespace("app", true), p))
	e, _ := h.reg.Get("uid-a")
	if e.Phase != registry.Pending || e.Netns == nil || e.Netns.Inode() != newNS.Inode {
		t.Fatalf("restored %v (%s) in %v, want pending in the new sandbox (inode %d)", e.Phase, e.Reason, e.Netns, newNS.Inode)
	}
	st, err := podnetns.OpenState(filepath.Join(runDir, "pods.json"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Has("uid-gone") {
		t.Error("the state file kept the record of a pod gone while the agent was down")
	}
	h.zt.connect()
	h.waitFor("enabled in the new sandbox", func() bool { return h.state("uid-a") == "enabled" })
}

// The host is never a pod: a hostNetwork pod annotated enabled (whose
// processes the /proc scan would find in the node's netns, which holds its
// IP) is not restored, looked up, Added or cleaned; its annotation goes. A
// CNI ADD for it does nothing, and one registered anyhow is released without
// a rule call.
func TestHostNetworkPodNeverAPod(t *testing.T) {
	hostProc := t.TempDir()
	fakeSandbox(t, hostProc, 100, "uid-h", "/proc/self/ns/net")
	hp := runningPod(pod("app", "host", "uid-h", map[string]string{podmeta.AnnotationRedirection: "enabled"}), "127.0.0.1")
	hp.Spec.HostNetwork = true
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), hp))
	h.zt.connect()
	if st := h.state("uid-h"); st != "absent" {
		t.Fatalf("hostNetwork pod restored as %s", st)
	}
	for _, e := range h.firstSnapshot() {
		if e.Workload.UID == "uid-h" {
			t.Errorf("hostNetwork pod in the first snapshot: %+v", e)
		}
	}
	h.waitFor("the hostNetwork pod's annotation removed", func() bool { _, ok := h.annotation("app", "host"); return !ok })
	if out, err := h.cni.HandleAdd(t.Context(), h.event(hp)); err != nil || out != NotInMesh {
		t.Errorf("CNI ADD of a hostNetwork pod: %v, %v; want NotInMesh", out, err)
	}
	// Registered anyhow (a bug elsewhere): released, no rule call.
	hd, err := podnetns.Open(h.podNetns)
	if err != nil {
		t.Fatal(err)
	}
	h.put(registry.Entry{UID: "uid-h", Name: "host", Namespace: "app", Netns: hd, Phase: registry.Enabled})
	h.agent.queue.Add("uid-h")
	h.waitFor("released", func() bool { return h.state("uid-h") == "absent" && h.zt.deleted("uid-h") })
	h.rules.mu.Lock()
	touched := len(h.rules.touched)
	h.rules.mu.Unlock()
	if touched != 0 || h.zt.added("uid-h") != 0 {
		t.Errorf("hostNetwork pod: %d rule calls, %d Adds; want none", touched, h.zt.added("uid-h"))
	}
}

// A cleanup at restart that fails (the rules of a pod that left the mesh
// while the agent was down) is retried by the pod's sync until it works.
func TestRestartCleanupRetried(t *testing.T) {
	podNS := testutil.NewNetNS(t)
	runDir := writeState(t, map[string]string{"uid-s": podNS.NS.Path()})
	stale := runningPod(pod("plain", "stale", "uid-s", nil), "127.0.0.1")
	rules := &fakeRules{probes: map[string][]netip.Addr{}, deleteFails: 2}
	h := newHarness(t, withRules(rules), withConfig(func(c *Config) { c.RunDir = runDir }), withObjects(namespace("plain", false), stale))
	h.waitFor("the stale pod's rules deleted", func() bool { _, deleted, _ := h.rules.counts(); return deleted == 1 })
	h.waitFor("its record dropped", func() bool {
		st, _ := podnetns.OpenState(filepath.Join(runDir, "pods.json"))
		return !st.Has("uid-s")
	})
	if h.state("uid-s") != "absent" {
		t.Errorf("stale pod registered: %s", h.state("uid-s"))
	}
}

// A sandbox recreated with the same (static) IP fires no pod event: the
// drift pass finds the held netns no longer named by the runtime's path,
// takes the pod out of it and its sync enrolls it in the new one.
func TestDriftPassFindsStaticIPSandboxChange(t *testing.T) {
	hostProc := t.TempDir()
	oldNS := testutil.NewNetNSWith(t, testutil.NetNSOptions{IgnoreRemovalErr: true})
	newNS := testutil.NewNetNS(t)
	p := runningPod(pod("app", "a", "uid-a", nil), "127.0.0.1")
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), p))
	h.zt.connect()
	ev := h.event(p)
	ev.NetnsPath = oldNS.NS.Path()
	if out, err := h.cni.HandleAdd(t.Context(), ev); err != nil || out != Enrolled {
		t.Fatalf("HandleAdd = %v, %v", out, err)
	}
	adds := h.zt.added("uid-a")
	// The runtime tears the sandbox down (lazily: our handle keeps it)
	// and makes a new one with the same address.
	if err := unix.Unmount(oldNS.NS.Path(), unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(oldNS.NS.Path()); err != nil {
		t.Fatal(err)
	}
	fakeSandbox(t, hostProc, 100, "uid-a", newNS.NS.Path())
	h.agent.VerifyPass(t.Context())
	h.waitFor("enabled in the new sandbox", func() bool {
		e, _ := h.reg.Get("uid-a")
		return e.Phase == registry.Enabled && e.Netns != nil && e.Netns.Inode() == newNS.Inode && h.zt.added("uid-a") > adds
	})
	if n := h.repairs("sandbox"); n != 1 {
		t.Errorf("repairs{sandbox} = %v, want 1", n)
	}
}

// An enrolled pod whose annotation turns invalid is verified against the
// options it was enrolled with (not the node's default).
func TestInvalidAnnotationVerifiedWithEnrolledOptions(t *testing.T) {
	p := pod("app", "a", "uid-a", map[string]string{podmeta.AnnotationDNSCapture: "false"})
	h := newHarness(t, withConfig(func(c *Config) { c.DNSCapture = true }), withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	patch := `{"metadata":{"annotations":{"` + podmeta.AnnotationDNSCapture + `":"maybe"}}}`
	if _, err := h.client.CoreV1().Pods("app").Patch(t.Context(), "a", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the cache sees the invalid value", func() bool {
		c := h.agent.podByUID("uid-a")
		return c != nil && c.Annotations[podmeta.AnnotationDNSCapture] == "maybe"
	})
	h.rules.mu.Lock()
	h.rules.drift = 1
	h.rules.mu.Unlock()
	h.agent.VerifyPass(t.Context())
	h.rules.mu.Lock()
	got := h.rules.verifiedWith
	h.rules.mu.Unlock()
	if got != (iptables.PodOptions{}) {
		t.Errorf("verified with %+v, want the enrolled options (DNS capture off)", got)
	}
	if h.repairs("pod_rules") != 1 || h.state("uid-a") != "enabled" {
		t.Errorf("drift of a pod with an invalid annotation: repairs %v, state %s; want repaired, enabled", h.repairs("pod_rules"), h.state("uid-a"))
	}
	h.waitFor("InvalidAnnotation Event", func() bool { return h.hasEvent("app", EventInvalidAnnotation, "keeps the value it was enrolled with") })
}

// The node's own netns is refused by every rule call, whoever asks.
func TestRuleCallsRefuseTheHost(t *testing.T) {
	h := newHarness(t)
	host, err := podnetns.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	for name, err := range map[string]error{
		"apply":  h.agent.writeRules(t.Context(), host, iptables.PodOptions{}),
		"delete": h.agent.deleteRules(t.Context(), host),
		"verify": func() error {
			_, err := h.agent.verifyRules(t.Context(), host, iptables.PodOptions{})
			return err
		}(),
	} {
		if !errors.Is(err, podnetns.ErrHostNetns) {
			t.Errorf("%s in the node's netns: %v, want ErrHostNetns", name, err)
		}
	}
	h.rules.mu.Lock()
	defer h.rules.mu.Unlock()
	if len(h.rules.touched) != 0 {
		t.Errorf("the rule manager was called for the node's netns: %v", h.rules.touched)
	}
	if slices.Contains(podnetns.HostNamespaces(h.agent.cfg.HostProc), host.ID()) != true {
		t.Error("HostNamespaces does not list this process's netns")
	}
}

// kubelet reports a new sandbox's addresses only after its CNI ADD
// returned: for a moment the API still shows the old sandbox's. A sync or
// drift pass in that moment must not take the API's stale addresses for a
// newer sandbox — the agent would leave the sandbox it just enrolled and,
// the old one still alive (its DEL comes later), enroll the pod in the old
// one (TestLateDelOfVanishedOldSandbox, e2e, caught it under load).
func TestAddOfNewSandboxBeforeTheAPIShowsIt(t *testing.T) {
	hostProc := t.TempDir()
	oldNS := netnsWith(t, "10.1.0.5")
	newNS := netnsWith(t, "10.1.0.6")
	p := runningPod(pod("app", "a", "uid-a", nil), "10.1.0.5")
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), p))
	fakeSandbox(t, hostProc, 100, "uid-a", oldNS.NS.Path()) // the old sandbox lives on, findable
	h.zt.connect()
	ev := h.event(p)
	ev.NetnsPath = oldNS.NS.Path()
	if out, err := h.cni.HandleAdd(t.Context(), ev); err != nil || out != Enrolled {
		t.Fatalf("ADD of the first sandbox: %v, %v", out, err)
	}
	h.waitFor("pod in the cache", func() bool { return h.agent.podByUID("uid-a") != nil })

	// The new sandbox's ADD; the API still shows 10.1.0.5.
	ev.NetnsPath, ev.IPs = newNS.NS.Path(), []netip.Prefix{netip.MustParsePrefix("10.1.0.6/24")}
	if out, err := h.cni.HandleAdd(t.Context(), ev); err != nil || out != Enrolled {
		t.Fatalf("ADD of the new sandbox: %v, %v", out, err)
	}
	inNew := func(when string) {
		t.Helper()
		e, _ := h.reg.Get("uid-a")
		if e.Phase != registry.Enabled || e.Netns == nil || e.Netns.Inode() != newNS.Inode {
			t.Fatalf("%s: %v in %v, want enabled in the new sandbox (inode %d; the old one is %d)", when, e.Phase, e.Netns, newNS.Inode, oldNS.Inode)
		}
	}
	inNew("after the new sandbox's ADD")
	h.agent.VerifyPass(t.Context())
	inNew("after a drift pass while the API shows the old sandbox's address")
	if n := h.repairs("sandbox"); n != 0 {
		t.Errorf("repairs{sandbox} = %v while the API lagged, want 0", n)
	}

	// kubelet catches up: still the new sandbox, nothing left lagging.
	cur, err := h.client.CoreV1().Pods("app").Get(t.Context(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	runningPod(cur, "10.1.0.6")
	if _, err := h.client.CoreV1().Pods("app").UpdateStatus(t.Context(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the API caught up", func() bool { e, _ := h.reg.Get("uid-a"); return e.LaggingAPIIPs == nil })
	h.agent.VerifyPass(t.Context())
	inNew("after the API caught up")
}
