package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/ambientd/ambientd/nodeagent/unixsock"
)

// Source answers the API's questions (the daemon implements it over the
// agent, the ztunnel server and the providers).
type Source interface {
	NodeStatus(ctx context.Context) NodeStatus
	// PodDetail returns the pod and its live rules; ErrNotFound when this
	// node has no such pod.
	PodDetail(ctx context.Context, namespace, name string) (PodDetail, error)
}

// ErrNotFound is a pod this node does not have.
var ErrNotFound = errors.New("no such pod on this node")

// Provider fills in what another part of the agent knows (plugin install
// state, node readiness, taint, rules verified per pod): the daemon calls
// each in turn on every status request. Providers must not block on I/O.
type Provider func(st *NodeStatus)

// Server serves the admin API on a Unix socket.
type Server struct {
	path string
	src  Source
	log  *slog.Logger
}

// NewServer returns a server for path (DefaultSocketPath when empty).
func NewServer(path string, src Source, log *slog.Logger) *Server {
	if path == "" {
		path = DefaultSocketPath
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{path: path, src: src, log: log.With("component", "admin")}
}

// Name implements the daemon's Component.
func (s *Server) Name() string { return "admin server " + s.path }

type connKey struct{}

// Run listens (mode 0600), calls ready, and serves until ctx ends; then it
// shuts down (2 s grace) and removes the socket if it is still ours.
func (s *Server) Run(ctx context.Context, ready func()) error {
	ln, sock, err := unixsock.Listen(s.path, "unix", 0o600)
	if err != nil {
		return fmt.Errorf("admin: %w", err)
	}
	defer sock.RemoveIfOurs(s.log)
	hs := &http.Server{
		Handler:           s.rootOnly(s.mux()),
		ReadHeaderTimeout: 5 * time.Second,
		// A status answer is small; a slow reader is not waited for.
		WriteTimeout: 30 * time.Second,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		},
	}
	stop := context.AfterFunc(ctx, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		hs.Shutdown(sctx)
	})
	defer stop()
	ready()
	s.log.Info("serving admin API", "socket", s.path)
	if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("admin: serve %s: %w", s.path, err)
	}
	return nil
}

// rootOnly refuses every request whose peer is not uid 0, like the CNI
// socket: the mode already keeps others out; this holds even if it is
// loosened.
func (s *Server) rootOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		uc, ok := r.Context().Value(connKey{}).(*net.UnixConn)
		if !ok {
			http.Error(w, "admin socket: not a Unix connection", http.StatusForbidden)
			return
		}
		cred, err := unixsock.PeerCred(uc)
		if err != nil {
			http.Error(w, "admin socket: "+err.Error(), http.StatusForbidden)
			return
		}
		if cred.Uid != 0 {
			s.log.Warn("refused admin call from non-root peer", "uid", cred.Uid, "pid", cred.Pid)
			http.Error(w, fmt.Sprintf("admin socket: peer uid %d is not root", cred.Uid), http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func (s *Server) mux() *http.ServeMux {
	m := http.NewServeMux()
	m.HandleFunc("GET "+PathStatus, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, s.src.NodeStatus(r.Context()))
	})
	m.HandleFunc("GET "+PathPod, func(w http.ResponseWriter, r *http.Request) {
		ns, name := r.URL.Query().Get("namespace"), r.URL.Query().Get("name")
		if name == "" {
			http.Error(w, "name is required", http.StatusBadRequest)
			return
		}
		d, err := s.src.PodDetail(r.Context(), ns, name)
		switch {
		case errors.Is(err, ErrNotFound):
			http.Error(w, err.Error(), http.StatusNotFound)
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
		default:
			writeJSON(w, http.StatusOK, d)
		}
	})
	return m
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}
