package ztunnelemu

import (
	"encoding/json"
	"net/http"
)

// Handler serves the emulator's control API:
//
//	GET    /state                          the State as JSON
//	POST   /nack?workload=ns/name&error=m  answer Adds of the workload with m
//	DELETE /nack?workload=ns/name          stop doing so
//	POST   /hang                           stop answering for good (Hang)
//
// workload may also be a pod uid.
func (e *Emulator) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /state", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(e.State())
	})
	mux.HandleFunc("POST /nack", func(w http.ResponseWriter, r *http.Request) {
		key, msg := r.URL.Query().Get("workload"), r.URL.Query().Get("error")
		if key == "" || msg == "" {
			http.Error(w, "need workload=<ns/name or uid> and error=<message>", http.StatusBadRequest)
			return
		}
		e.SetNack(key, msg)
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("POST /hang", func(w http.ResponseWriter, _ *http.Request) {
		e.Hang()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("DELETE /nack", func(w http.ResponseWriter, r *http.Request) {
		key := r.URL.Query().Get("workload")
		if key == "" {
			http.Error(w, "need workload=<ns/name or uid>", http.StatusBadRequest)
			return
		}
		e.ClearNack(key)
		w.WriteHeader(http.StatusNoContent)
	})
	return mux
}
