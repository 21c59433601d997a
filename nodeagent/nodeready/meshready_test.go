package nodeready

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// meshReady reads ambientd_node_mesh_ready_seconds: its count and sum.
func (h *harness) meshReady(t *testing.T) (uint64, float64) {
	t.Helper()
	var m dto.Metric
	if err := h.c.Metrics().(prometheus.Histogram).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}

// TestNodeMeshReadyObservedOnce: from the process's start to the first
// reconcile that leaves the node's condition True, observed once; the
// node going False and True again later is not a start.
func TestNodeMeshReadyObservedOnce(t *testing.T) {
	h := newHarness(t, Config{})
	h.reconcile(t) // nothing ready: False
	if n, _ := h.meshReady(t); n != 0 {
		t.Fatalf("%d observations with the condition False", n)
	}
	h.clock.step(7 * time.Second)
	h.in.set(true, ztReady)
	h.reconcile(t)
	if n, sum := h.meshReady(t); n != 1 || sum != 7 {
		t.Fatalf("after the condition went True 7 s after the start: %d observations, sum %v; want 1, 7", n, sum)
	}
	h.clock.step(time.Minute)
	h.in.set(true, ZtunnelState{}) // ztunnel gone: False
	h.reconcile(t)
	h.in.set(true, ztReady)
	h.reconcile(t)
	if n, sum := h.meshReady(t); n != 1 || sum != 7 {
		t.Errorf("after False and True again: %d observations, sum %v; want still 1, 7", n, sum)
	}
}
