package agent

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Live reports whether the agent's loops run: before the caches sync (the API
// may be slow) that is simply true; afterwards every worker and the snapshot
// loop must be running.
func (a *Agent) Live() error {
	if !a.running.Load() {
		return nil
	}
	if n := a.liveLoops.Load(); n < a.wantLoops {
		return fmt.Errorf("%d of %d agent loops running", n, a.wantLoops)
	}
	return nil
}

// Metrics returns the agent's metrics registry; the daemon serves it and
// registers the servers' collectors in it.
func (a *Agent) Metrics() *prometheus.Registry { return a.metrics.reg }

// Started reports whether the agent's informer caches have synced and its
// registry is rebuilt (an input of readiness: nodeready.Inputs).
func (a *Agent) Started() bool { return a.synced.Load() && a.running.Load() }
