package agent

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// The drift pass reads every enrolled pod's rules back: intact ones are not
// written; drifted ones are rewritten and counted; a pod whose repair fails
// goes pending (never enabled while uncaptured) and is enabled again once
// a retry repairs it.
func TestVerifyPassRepairsDrift(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	applied0, _, _ := h.rules.counts()

	h.agent.VerifyPass(t.Context())
	if applied, _, _ := h.rules.counts(); applied != applied0 {
		t.Errorf("intact pod: %d rule writes in a pass, want 0", applied-applied0)
	}

	h.rules.mu.Lock()
	h.rules.drift = 1
	h.rules.mu.Unlock()
	h.agent.VerifyPass(t.Context())
	if applied, _, _ := h.rules.counts(); applied != applied0+1 {
		t.Errorf("drifted pod: %d rule writes, want 1", applied-applied0)
	}
	if n := h.repairs("pod_rules"); n != 1 {
		t.Errorf("repairs{pod_rules} = %v, want 1", n)
	}
	if h.state("uid-a") != "enabled" {
		t.Errorf("repaired pod state %s, want enabled", h.state("uid-a"))
	}

	h.rules.mu.Lock()
	h.rules.drift, h.rules.applyErr = 1000, errors.New("iptables-restore: exit 4")
	h.rules.mu.Unlock()
	h.agent.VerifyPass(t.Context())
	if st := h.state("uid-a"); st != "uncaptured" {
		t.Fatalf("unrepairable pod state %s, want uncaptured", st)
	}
	if _, _, probes := h.rules.counts(); probes != 0 {
		t.Errorf("unrepairable pod kept its probe entry (%d): kubelet's probes would be SNATed into a pod whose capture is unknown", probes)
	}
	h.waitFor("annotation pending", func() bool { v, _ := h.annotation("app", "a"); return v == "pending" })
	if e, _ := h.reg.Get("uid-a"); !strings.Contains(e.LastError, "exit 4") {
		t.Errorf("LastError %q does not say why", e.LastError)
	}

	h.rules.mu.Lock()
	h.rules.applyErr = nil
	h.rules.mu.Unlock()
	h.waitFor("pod repaired by its retry and enabled", func() bool {
		v, _ := h.annotation("app", "a")
		return h.state("uid-a") == "enabled" && v == "enabled"
	})
}

// The drift pass prunes the probe set to the enabled pods.
func TestVerifyPassPrunesProbeSet(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	h.rules.mu.Lock()
	h.rules.probes["uid-gone"] = []netip.Addr{netip.MustParseAddr("10.1.0.99")}
	h.rules.mu.Unlock()
	h.agent.VerifyPass(t.Context())
	h.rules.mu.Lock()
	defer h.rules.mu.Unlock()
	if _, ok := h.rules.probes["uid-gone"]; ok {
		t.Error("probe entry of a pod the agent does not hold survived the pass")
	}
	if _, ok := h.rules.probes["uid-a"]; !ok {
		t.Error("enabled pod lost its probe entry")
	}
	if n := h.repairs("probe_set"); n != 1 {
		t.Errorf("repairs{probe_set} = %v, want 1 (the stale entry)", n)
	}
}

// With IPv6 capture off, a pod with an IPv6 address fails its ADD rather
// than run with IPv6 uncaptured.
func TestIPv6OffRefusesIPv6Pod(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withObjects(namespace("app", true), p))
	h.zt.connect()
	ev := h.event(p)
	ev.IPs = []netip.Prefix{netip.MustParsePrefix("10.1.0.5/24"), netip.MustParsePrefix("fd00::5/64")}
	_, err := h.cni.HandleAdd(t.Context(), ev)
	if !errors.Is(err, ErrNotCaptured) || !strings.Contains(err.Error(), "--ipv6=false") {
		t.Fatalf("HandleAdd = %v, want ErrNotCaptured naming --ipv6=false", err)
	}
	if h.state("uid-a") != "absent" {
		t.Errorf("refused pod state %s, want absent", h.state("uid-a"))
	}
	if applied, _, _ := h.rules.counts(); applied != 0 {
		t.Errorf("rules applied %d times for a refused pod", applied)
	}
}

// A late CNI DEL naming another (still existing) netns than the pod's own
// leaves the pod alone, uid given or not.
func TestCNIDelOfOtherSandboxIgnored(t *testing.T) {
	h := newHarness(t, withRealNetns(), withObjects(namespace("app", true)))
	other := testutil.NewNetNS(t)
	f, err := podnetns.Open(h.podNetns)
	if err != nil {
		t.Fatal(err)
	}
	h.put(registry.Entry{UID: "uid-a", Name: "a", Namespace: "app", Netns: f, Phase: registry.Enabled})
	for _, ev := range []PodEvent{
		{Namespace: "app", Name: "a", UID: "uid-a", NetnsPath: other.NS.Path()},
		{Namespace: "app", Name: "a", NetnsPath: other.NS.Path()},
	} {
		if err := h.cni.HandleDel(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
		if h.state("uid-a") != "enabled" {
			t.Fatalf("DEL %+v of another sandbox dropped the pod", ev)
		}
	}
	// A DEL naming a netns that is gone while the pod's own is still at
	// its path (a late DEL of an old sandbox) leaves it too.
	if err := h.cni.HandleDel(t.Context(), PodEvent{Namespace: "app", Name: "a", UID: "uid-a", NetnsPath: "/nonexistent"}); err != nil {
		t.Fatal(err)
	}
	if h.state("uid-a") != "enabled" {
		t.Errorf("DEL with another, vanished netns: state %s, want enabled", h.state("uid-a"))
	}
	// The pod's own netns does drop it (no pod object here: forgotten).
	if err := h.cni.HandleDel(t.Context(), PodEvent{Namespace: "app", Name: "a", UID: "uid-a", NetnsPath: h.podNetns}); err != nil {
		t.Fatal(err)
	}
	if h.state("uid-a") != "absent" {
		t.Errorf("DEL of the pod's own netns: state %s, want absent", h.state("uid-a"))
	}
}

// A lock wait gives up when the caller's context ends; the lock is still
// usable afterwards.
func TestPodLockHonoursDeadline(t *testing.T) {
	var k keyedMutex
	unlock := k.lock("uid-a")
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if _, err := k.lockCtx(ctx, "uid-a"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("lockCtx on a held lock = %v, want the deadline", err)
	}
	unlock()
	u2, err := k.lockCtx(t.Context(), "uid-a")
	if err != nil {
		t.Fatal(err)
	}
	u2()
	if len(k.m) != 0 {
		t.Errorf("lock entries left: %d", len(k.m))
	}
}

// An enabled pod whose IPs change in the API is in a new sandbox (kubelet
// reports new IPs only for one): it leaves the old one at once — pending
// with the condition False, its probe entry removed, never moved to the
// new IPs while they belong to an uncaptured sandbox — and is enrolled in
// the new sandbox (found by the /proc scan: its netns holds the new IP):
// rules, probe entry, a fresh Add with the new netns, enabled.
func TestEnabledPodIPChangeIsANewSandbox(t *testing.T) {
	hostProc := t.TempDir()
	newNS := netnsWith(t, "10.1.0.77") // made first: the agent may hold it at cleanup
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withConfig(func(c *Config) { c.HostProc = hostProc }), withObjects(namespace("app", true), p))
	h.enrollConnected(p)
	first := h.zt.added("uid-a")

	// No new sandbox to be found yet: the pod leaves the old one.
	cur, err := h.client.CoreV1().Pods("app").Get(t.Context(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	runningPod(cur, "10.1.0.77")
	if _, err := h.client.CoreV1().Pods("app").UpdateStatus(t.Context(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("pod uncaptured, pending and False", func() bool {
		c := h.condition("app", "a")
		v, _ := h.annotation("app", "a")
		return h.state("uid-a") == "uncaptured" && v == "pending" && c != nil && c.Status == corev1.ConditionFalse && c.Reason == ReasonSandboxChanged
	})
	h.rules.mu.Lock()
	_, probe := h.rules.probes["uid-a"]
	h.rules.mu.Unlock()
	if probe {
		t.Error("probe entry kept (or moved to the new IP) while the new sandbox is uncaptured")
	}
	if e, _ := h.reg.Get("uid-a"); e.Netns != nil {
		t.Errorf("still holding the old sandbox's netns %v", e.Netns)
	}

	// The new sandbox appears: found, captured, Added with its netns.
	fakeSandbox(t, hostProc, 200, "uid-a", newNS.NS.Path())
	h.waitFor("pod enabled in its new sandbox", func() bool {
		v, _ := h.annotation("app", "a")
		return h.state("uid-a") == "enabled" && v == "enabled" && h.zt.added("uid-a") > first
	})
	e, _ := h.reg.Get("uid-a")
	if e.Netns == nil || e.Netns.Inode() != newNS.Inode {
		t.Errorf("enrolled in netns %v, want the new sandbox (inode %d)", e.Netns, newNS.Inode)
	}
	h.rules.mu.Lock()
	ips := h.rules.probes["uid-a"]
	h.rules.mu.Unlock()
	if want := netip.MustParseAddr("10.1.0.77"); len(ips) != 1 || ips[0] != want {
		t.Errorf("probe entry %v, want the new IP %s", ips, want)
	}
	if n := h.repairs("sandbox"); n != 1 {
		t.Errorf("repairs{sandbox} = %v, want 1", n)
	}
	h.waitFor("SandboxChanged Event", func() bool { return h.hasEvent("app", EventSandboxChanged, "IPs changed") })
}
