package agent

import (
	"context"
	"errors"
	"testing"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// TestHandOverMovesEnrolledPodsAndReleasesTheRest: when the agent stops and
// a successor takes the node over, the enrolled pods' rules go to the
// successor's backend with each pod's own options; a registered pod that is
// no longer in the mesh, or whose object is gone, has its rules removed
// instead (no agent would ever consider it enrolled); a pod whose netns was
// never found is left alone. The annotations stay and ztunnel is told
// nothing: it keeps serving the pods until the successor's snapshot.
func TestHandOverMovesEnrolledPodsAndReleasesTheRest(t *testing.T) {
	to := &fakeSuccessor{}
	asked := 0
	a := pod("app", "a", "uid-a", nil)
	b := pod("app", "b", "uid-b", map[string]string{podmeta.AnnotationDNSCapture: "false", podmeta.AnnotationBypassInbound: "true"})
	out := pod("app", "out", "uid-out", nil)
	out.Labels = map[string]string{podmeta.LabelDataplaneMode: "none"}
	h := newHarness(t, withConfig(func(c *Config) {
		c.DNSCapture = true
		c.HandOver = func(context.Context) (SuccessorRules, error) { asked++; return to, nil }
	}), withObjects(namespace("app", true), a, b, out))
	h.enrollConnected(a)
	h.enrollConnected(b)
	// Registered as a restart leaves them, never synced since: out (now
	// labelled none), gone (no pod object any more) and lost (its netns
	// never found).
	for _, uid := range []string{"uid-out", "uid-gone"} {
		nsh, err := podnetns.Open("/proc/self/ns/net")
		if err != nil {
			t.Fatal(err)
		}
		h.put(registry.Entry{UID: uid, Name: uid, Namespace: "app", Phase: registry.Enabled, Netns: nsh})
	}
	h.put(registry.Entry{UID: "uid-lost", Name: "lost", Namespace: "app", Phase: registry.Pending})
	_, deletedBefore, _ := h.rules.counts()

	h.stop()

	if asked != 1 {
		t.Errorf("HandOver asked %d times, want once", asked)
	}
	moved := to.moved()
	if len(moved) != 2 {
		t.Fatalf("moved %d pods (%+v), want a and b", len(moved), moved)
	}
	want := map[iptables.PodOptions]bool{{DNSCapture: true}: true, {DNSCapture: false, BypassInbound: true}: true}
	for _, o := range moved {
		if !want[o] {
			t.Errorf("moved with options %+v, want one of %v", o, want)
		}
		delete(want, o)
	}
	if _, deleted, _ := h.rules.counts(); deleted-deletedBefore != 2 {
		t.Errorf("rules deleted in %d pods at the handover, want 2 (out of the mesh, gone)", deleted-deletedBefore)
	}
	for _, name := range []string{"a", "b"} {
		if v, _ := h.annotation("app", name); v != podmeta.RedirectionEnabled {
			t.Errorf("pod %s annotation %q after the handover, want it left enabled", name, v)
		}
	}
	for _, uid := range []string{"uid-a", "uid-b"} {
		if h.zt.deleted(uid) {
			t.Errorf("ztunnel got a Del for %s at the handover", uid)
		}
	}
}

// TestHandOverNotWanted: without a successor (nil, as at an upgrade) or
// when the successor's backend cannot be told (an error), no pod's rules
// are touched when the agent stops.
func TestHandOverNotWanted(t *testing.T) {
	for name, ret := range map[string]error{"none": nil, "error": errors.New("cannot read the node")} {
		t.Run(name, func(t *testing.T) {
			a := pod("app", "a", "uid-a", nil)
			h := newHarness(t, withConfig(func(c *Config) {
				c.HandOver = func(context.Context) (SuccessorRules, error) { return nil, ret }
			}), withObjects(namespace("app", true), a))
			h.enrollConnected(a)
			applied, deleted, _ := h.rules.counts()
			h.stop()
			if a2, d2, _ := h.rules.counts(); a2 != applied || d2 != deleted {
				t.Errorf("rules touched at a stop without handover: applied %d→%d, deleted %d→%d", applied, a2, deleted, d2)
			}
		})
	}
}

// TestHandOverFailureKeepsOurRules: a pod whose rules cannot be written in
// the successor's backend keeps ours (ApplyPod writes there before it
// removes anything), and the others are still moved.
func TestHandOverFailureKeepsOurRules(t *testing.T) {
	to := &fakeSuccessor{fails: true}
	a := pod("app", "a", "uid-a", nil)
	h := newHarness(t, withConfig(func(c *Config) {
		c.HandOver = func(context.Context) (SuccessorRules, error) { return to, nil }
	}), withObjects(namespace("app", true), a))
	h.enrollConnected(a)
	_, deleted, _ := h.rules.counts()
	h.stop()
	if _, d2, _ := h.rules.counts(); d2 != deleted {
		t.Errorf("our rules deleted after the successor refused the pod")
	}
}
