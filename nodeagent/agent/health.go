package agent

import (
	"errors"
	"fmt"
	"strings"

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

// Ready reports whether the agent can do its job: informer caches synced,
// registry rebuilt, a ztunnel connected and its snapshot acked. The error
// lists every failed check. (The daemon adds the CNI socket's check.)
func (a *Agent) Ready() error {
	var failed []string
	if !a.synced.Load() {
		failed = append(failed, "informer caches not synced")
	}
	if !a.running.Load() {
		failed = append(failed, "registry not rebuilt yet")
	}
	st := a.zt.Status()
	switch {
	case st.Connections == 0:
		failed = append(failed, "no ztunnel connected")
	case !st.SnapshotAcked:
		failed = append(failed, "ztunnel has not acked its snapshot")
	}
	if len(failed) > 0 {
		return errors.New(strings.Join(failed, "; "))
	}
	return nil
}

// Metrics returns the agent's metrics registry; the daemon serves it and
// registers the servers' collectors in it.
func (a *Agent) Metrics() *prometheus.Registry { return a.metrics.reg }

// CachesSynced reports whether the agent's informer caches have synced (an
// input of the node condition).
func (a *Agent) CachesSynced() bool { return a.synced.Load() }
