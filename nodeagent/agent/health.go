package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Live reports whether the process is alive and its loops run: before the
// caches sync (the API may be slow) that is simply true; afterwards every
// worker and the snapshot loop must be running.
func (a *Agent) Live() error {
	if !a.running.Load() {
		return nil
	}
	if n := a.liveLoops.Load(); n < a.wantLoops {
		return fmt.Errorf("%d of %d agent loops running", n, a.wantLoops)
	}
	return nil
}

// Ready reports whether the agent can do its job: informer caches synced, CNI
// socket serving, a ztunnel connected and its snapshot acked. The error lists
// every failed check.
func (a *Agent) Ready() error {
	var failed []string
	if !a.synced.Load() {
		failed = append(failed, "informer caches not synced")
	}
	if !a.running.Load() {
		failed = append(failed, "registry not rebuilt yet")
	}
	if a.cniServing == nil || !a.cniServing() {
		failed = append(failed, "CNI socket not serving")
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

// HealthHandler serves /healthz (Live) and /readyz (Ready).
func (a *Agent) HealthHandler() http.Handler {
	mux := http.NewServeMux()
	check := func(f func() error) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			if err := f(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		}
	}
	mux.Handle("/healthz", check(a.Live))
	mux.Handle("/readyz", check(a.Ready))
	return mux
}

// MetricsHandler serves the agent's Prometheus metrics.
func (a *Agent) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(a.metrics.reg, promhttp.HandlerOpts{})
}

// serveHTTP starts the health and metrics listeners (bound before returning,
// so a bad address fails the start) and stops them when ctx ends.
func (a *Agent) serveHTTP(ctx context.Context, wg *sync.WaitGroup, fail func(string, error)) error {
	for _, c := range a.cfg.Collectors {
		if err := a.metrics.reg.Register(c); err != nil {
			return fmt.Errorf("register metrics: %w", err)
		}
	}
	type srv struct {
		flag, addr string
		h          http.Handler
	}
	var lns []net.Listener
	for _, s := range []srv{{"--health-addr", a.cfg.HealthAddr, a.HealthHandler()}, {"--metrics-addr", a.cfg.MetricsAddr, a.MetricsHandler()}} {
		if s.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return fmt.Errorf("%s %s: %w", s.flag, s.addr, err)
		}
		lns = append(lns, ln)
		hs := &http.Server{Handler: s.h, ReadHeaderTimeout: 5 * time.Second}
		wg.Go(func() {
			if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				fail(s.flag+" server", err)
			}
		})
		context.AfterFunc(ctx, func() {
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			hs.Shutdown(sctx)
		})
	}
	return nil
}
