package agent

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

func (h *harness) repairs(what string) float64 {
	h.t.Helper()
	var m dto.Metric
	if err := h.agent.metrics.repairs.WithLabelValues(what).Write(&m); err != nil {
		h.t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// The drift pass reads every enrolled pod's rules back: intact ones are not
// written; drifted ones are rewritten and counted; a pod whose repair fails
// goes pending (never enabled while uncaptured) and is enabled again once
// a retry repairs it.
func TestVerifyPassRepairsDrift(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, namespace("app", true), p)
	h.enrollConnected(p)
	applied0, _, _ := h.rules.counts()

	h.agent.VerifyPass(context.Background())
	if applied, _, _ := h.rules.counts(); applied != applied0 {
		t.Errorf("intact pod: %d rule writes in a pass, want 0", applied-applied0)
	}

	h.rules.mu.Lock()
	h.rules.drift = 1
	h.rules.mu.Unlock()
	h.agent.VerifyPass(context.Background())
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
	h.agent.VerifyPass(context.Background())
	if st := h.state("uid-a"); st != "pending" {
		t.Fatalf("unrepairable pod state %s, want pending", st)
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
	h := newHarness(t, namespace("app", true), p)
	h.enrollConnected(p)
	h.rules.mu.Lock()
	h.rules.probes["uid-gone"] = []netip.Addr{netip.MustParseAddr("10.1.0.99")}
	h.rules.mu.Unlock()
	h.agent.VerifyPass(context.Background())
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
	h := newHarness(t, namespace("app", true), p)
	h.zt.connect()
	ev := event(p)
	ev.IPs = []netip.Prefix{netip.MustParsePrefix("10.1.0.5/24"), netip.MustParsePrefix("fd00::5/64")}
	_, err := h.agent.HandleAdd(context.Background(), ev)
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
	h := newHarness(t, namespace("app", true))
	other := testutil.NewNetNS(t)
	f, err := podnetns.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	h.put(registry.Entry{UID: "uid-a", Name: "a", Namespace: "app", Netns: f, Phase: registry.Enabled})
	for _, ev := range []PodEvent{
		{Namespace: "app", Name: "a", UID: "uid-a", NetnsPath: other.NS.Path()},
		{Namespace: "app", Name: "a", NetnsPath: other.NS.Path()},
	} {
		if err := h.agent.HandleDel(context.Background(), ev); err != nil {
			t.Fatal(err)
		}
		if h.state("uid-a") != "enabled" {
			t.Fatalf("DEL %+v of another sandbox dropped the pod", ev)
		}
	}
	// The pod's own netns, or one that is gone, does drop it.
	if err := h.agent.HandleDel(context.Background(), PodEvent{Namespace: "app", Name: "a", UID: "uid-a", NetnsPath: "/nonexistent"}); err != nil {
		t.Fatal(err)
	}
	if h.state("uid-a") != "absent" {
		t.Errorf("DEL with a vanished netns: state %s, want absent", h.state("uid-a"))
	}
}

// A lock wait gives up when the caller's context ends; the lock is still
// usable afterwards.
func TestPodLockHonoursDeadline(t *testing.T) {
	var k keyedMutex
	unlock := k.lock("uid-a")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := k.lockCtx(ctx, "uid-a"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("lockCtx on a held lock = %v, want the deadline", err)
	}
	unlock()
	u2, err := k.lockCtx(context.Background(), "uid-a")
	if err != nil {
		t.Fatal(err)
	}
	u2()
	if len(k.m) != 0 {
		t.Errorf("lock entries left: %d", len(k.m))
	}
}

// An enabled pod whose IPs change in the API (the ADD carried none, here)
// gets its probe entry moved to the new IPs.
func TestEnabledPodIPChangeMovesProbeEntry(t *testing.T) {
	p := pod("app", "a", "uid-a", nil)
	h := newHarness(t, namespace("app", true), p)
	h.enrollConnected(p)
	cur, err := h.client.CoreV1().Pods("app").Get(context.Background(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	runningPod(cur, "10.1.0.77")
	if _, err := h.client.CoreV1().Pods("app").UpdateStatus(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	want := netip.MustParseAddr("10.1.0.77")
	h.waitFor("probe entry on the new IP", func() bool {
		h.rules.mu.Lock()
		defer h.rules.mu.Unlock()
		ips := h.rules.probes["uid-a"]
		return len(ips) == 1 && ips[0] == want
	})
	if e, _ := h.reg.Get("uid-a"); e.Phase != registry.Enabled || len(e.IPs) != 1 || e.IPs[0] != want {
		t.Errorf("entry %+v, want enabled with IP %s", e, want)
	}
}
