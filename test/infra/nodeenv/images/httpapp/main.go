// Command httpapp is the node environment's tiny application image: an HTTP
// server whose /healthz serves readiness probes and whose / answers with the
// pod's name, and whose /ls?dir=PATH lists a directory inside the container
// (tests use it to look at hostPath volumes from a pod). Every request is
// logged with its client address, so a test can see where kubelet's probes
// come from (`kubectl logs`).
//
//	httpapp [-listen :8080]   (env HTTPAPP_LISTEN)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	listen := flag.String("listen", envOr("HTTPAPP_LISTEN", ":8080"), "listen address (env HTTPAPP_LISTEN)")
	flag.Parse()
	host, _ := os.Hostname()
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		log.Printf("probe %s from %s", r.URL.Path, r.RemoteAddr)
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/ls", func(w http.ResponseWriter, r *http.Request) {
		log.Printf("request %s from %s", r.URL, r.RemoteAddr)
		entries, err := os.ReadDir(r.URL.Query().Get("dir"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusNotFound)
			return
		}
		for _, e := range entries {
			fmt.Fprintln(w, e.Name())
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		log.Printf("request %s from %s", r.URL.Path, r.RemoteAddr)
		fmt.Fprintf(w, "hello from %s\n", host)
	})
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Printf("httpapp %s listening on %s", host, *listen)
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatalf("httpapp: %v", err)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
