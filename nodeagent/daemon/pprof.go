package daemon

import (
	"net/http"
	"net/http/pprof"
)

// pprofHandler serves Go's profiling endpoints (CPU, heap, allocations,
// goroutines, execution trace) under /debug/pprof/, for --pprof-addr.
func pprofHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}
