package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"

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

type connKey struct{}

// ConnContext is the http.Server hook the admin API needs: it hands each
// request its connection, whose peer credentials Handler checks.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// Handler serves the API from src to root peers only. Serve it on a Unix
// socket created with mode 0600, with ConnContext as the server's hook.
func Handler(src Source, log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return rootOnly(log.With("component", "admin"), mux(src))
}

// rootOnly refuses every request whose peer is not uid 0, like the CNI
// socket: the mode already keeps others out; this holds even if it is
// loosened.
func rootOnly(log *slog.Logger, h http.Handler) http.Handler {
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
			log.Warn("refused admin call from non-root peer", "uid", cred.Uid, "pid", cred.Pid)
			http.Error(w, fmt.Sprintf("admin socket: peer uid %d is not root", cred.Uid), http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func mux(src Source) *http.ServeMux {
	m := http.NewServeMux()
	m.HandleFunc("GET "+PathStatus, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, src.NodeStatus(r.Context()))
	})
	m.HandleFunc("GET "+PathPod, func(w http.ResponseWriter, r *http.Request) {
		ns, name := r.URL.Query().Get("namespace"), r.URL.Query().Get("name")
		if name == "" {
			http.Error(w, "name is required", http.StatusBadRequest)
			return
		}
		d, err := src.PodDetail(r.Context(), ns, name)
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
