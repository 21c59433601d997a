package agent

import (
	"math"
	"testing"
	"time"
)

// TestCNIAddBreakdown: an enrolled ADD shows every step from the plugin's
// start to the agent's answer once in ambientd_cni_add_step_duration_seconds
// (the plugin's reported steps as sent, the dial from its clock to the
// server's), the agent's steps adding up to no more than its whole answer;
// an ADD of a pod not in the mesh adds no rule or ztunnel step (its netns
// is opened all the same: every ADD opens it once, before the lookup); reported
// steps that are no measurement (negative, clocks apart) are dropped.
func TestCNIAddBreakdown(t *testing.T) {
	in := pod("app", "a", "uid-a", nil)
	out := pod("plain", "b", "uid-b", nil)
	h := newHarness(t, withObjects(namespace("app", true), namespace("plain", false), in, out))
	h.zt.connect()

	received := time.Now()
	ev := h.event(in)
	ev.Plugin = PluginTimings{Init: 3 * time.Millisecond, Config: time.Millisecond, CallStart: received.Add(-2 * time.Millisecond)}
	ev.Received = received
	if o, err := h.cni.HandleAdd(t.Context(), ev); err != nil || o != Enrolled {
		t.Fatalf("HandleAdd = %v, %v; want Enrolled", o, err)
	}
	got := h.addSteps()
	for _, s := range addSteps {
		if got[s].count != 1 {
			t.Errorf("step %s observed %d times after one enrolled ADD, want 1", s, got[s].count)
		}
	}
	for s, want := range map[string]float64{"plugin_init": 0.003, "plugin_config": 0.001, "dial": 0.002} {
		if math.Abs(got[s].sum-want) > 1e-9 {
			t.Errorf("step %s = %vs, want %vs (as the plugin reported)", s, got[s].sum, want)
		}
	}
	var parts float64
	for _, s := range []string{"check", "netns", "lookup", "queue", "rules", "ztunnel_ack", "probe_ips"} {
		parts += got[s].sum
	}
	if parts > got["agent"].sum {
		t.Errorf("the agent's steps sum to %vs, more than its whole answer %vs", parts, got["agent"].sum)
	}

	ev = h.event(out)
	ev.Plugin = PluginTimings{Init: -time.Second, Config: 10 * time.Minute, CallStart: time.Now().Add(time.Hour)}
	ev.Received = time.Now()
	if o, err := h.cni.HandleAdd(t.Context(), ev); err != nil || o != NotInMesh {
		t.Fatalf("HandleAdd = %v, %v; want NotInMesh", o, err)
	}
	got = h.addSteps()
	for s, want := range map[string]int{"agent": 2, "check": 2, "lookup": 2, "rules": 1, "ztunnel_ack": 1, "probe_ips": 1, "netns": 2, "plugin_init": 1, "plugin_config": 1, "dial": 1} {
		if got[s].count != want {
			t.Errorf("after an ADD not in the mesh with unusable plugin timings: step %s observed %d times, want %d", s, got[s].count, want)
		}
	}
}

type histo struct {
	count int
	sum   float64
}

// addSteps reads ambientd_cni_add_step_duration_seconds by step.
func (h *harness) addSteps() map[string]histo {
	h.t.Helper()
	mfs, err := h.agent.Metrics().Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	out := map[string]histo{}
	for _, mf := range mfs {
		if mf.GetName() != "ambientd_cni_add_step_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "step" {
					out[l.GetValue()] = histo{int(m.GetHistogram().GetSampleCount()), m.GetHistogram().GetSampleSum()}
				}
			}
		}
	}
	return out
}
