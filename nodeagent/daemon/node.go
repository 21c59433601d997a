package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/kubernetes"

	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/cniserver"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// Config configures a Node. Zero socket paths take the servers' defaults;
// an empty address disables that listener.
type Config struct {
	Agent                    agent.Config
	ZtunnelSocket, CNISocket string
	// HealthAddr serves /healthz and /readyz; MetricsAddr serves /metrics.
	HealthAddr, MetricsAddr string
	// AdminSocket serves `ambientd status` (admin.DefaultSocketPath when
	// empty). StatusProviders add what other parts know (plugin, node
	// readiness, taint, rule verification) to its answers.
	AdminSocket     string
	StatusProviders []admin.Provider
	Version         string
	// PluginInstalled, when set, checks that our CNI plugin is in the node's
	// CNI config (nil: installed); it feeds ambientd_cni_plugin_installed
	// and the status's plugin field. Unset, both are absent / unknown.
	PluginInstalled func() error
}

// Node is the whole node agent process: the agent core, its two socket
// servers, the status writer and the HTTP listeners.
type Node struct {
	cfg   Config
	log   *slog.Logger
	agent *agent.Agent
	zt    *ztunnel.Server
	cni   *cniserver.Server
}

// snapshotSource forwards the ztunnel server's snapshot calls to the agent,
// which is created after the server (the agent needs the server).
type snapshotSource struct{ a *agent.Agent }

func (s *snapshotSource) Snapshot() []ztunnel.SnapshotEntry     { return s.a.Snapshot() }
func (s *snapshotSource) SnapshotRefused(uid string, err error) { s.a.SnapshotRefused(uid, err) }

var _ ztunnel.SnapshotRefusalObserver = (*snapshotSource)(nil)

// New builds the node agent: both socket servers are wired the same way,
// with the agent behind them.
func New(cfg Config, client kubernetes.Interface, rules agent.Rules, log *slog.Logger) (*Node, error) {
	src := &snapshotSource{}
	zs := ztunnel.NewServer(ztunnel.Config{SocketPath: cfg.ZtunnelSocket}, src, log)
	a, err := agent.New(cfg.Agent, client, zs, rules, registry.New(), log)
	if err != nil {
		return nil, err
	}
	src.a = a
	if err := a.Metrics().Register(zs.Metrics()); err != nil {
		return nil, fmt.Errorf("register ztunnel metrics: %w", err)
	}
	if err := registerPluginCheck(&cfg, a.Metrics()); err != nil {
		return nil, err
	}
	cs := cniserver.New(cniserver.Config{SocketPath: cfg.CNISocket}, a, log)
	return &Node{cfg: cfg, log: log, agent: a, zt: zs, cni: cs}, nil
}

// components lists the parts of the process in start order (see Run): the
// listeners first (a bad address fails the start), the status writer, the
// agent (ready once its registry is rebuilt), then the servers that feed it.
func (n *Node) components() []Component {
	var cs []Component
	if n.cfg.HealthAddr != "" {
		cs = append(cs, HTTP("--health-addr server", n.cfg.HealthAddr, n.healthHandler()))
	}
	if n.cfg.MetricsAddr != "" {
		cs = append(cs, HTTP("--metrics-addr server", n.cfg.MetricsAddr, promhttp.HandlerFor(n.agent.Metrics(), promhttp.HandlerOpts{})))
	}
	return append(cs,
		n.adminServer(),
		Func("status writer", n.agent.RunStatusWriter),
		Staged("agent", n.agent.Run),
		Func("ztunnel server", n.zt.Run),
		Func("CNI server", n.cni.Run),
	)
}

// Run runs the node agent until ctx ends (nil) or a part fails (its error).
func (n *Node) Run(ctx context.Context) error {
	return Run(ctx, n.log.With("component", "daemon"), n.components()...)
}

// Ready is /readyz: the agent's checks and the CNI socket.
func (n *Node) Ready() error {
	var failed []string
	if err := n.agent.Ready(); err != nil {
		failed = append(failed, err.Error())
	}
	if !n.cni.Serving() {
		failed = append(failed, "CNI socket not serving")
	}
	if len(failed) > 0 {
		return errors.New(strings.Join(failed, "; "))
	}
	return nil
}

func (n *Node) healthHandler() http.Handler {
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
	mux.Handle("/healthz", check(n.agent.Live))
	mux.Handle("/readyz", check(n.Ready))
	return mux
}

// HTTP is a Component serving h on addr: ready once the listener is bound
// (so a bad address fails the start), shut down gracefully when stopped.
func HTTP(name, addr string, h http.Handler) Component {
	return Staged(name, func(ctx context.Context, ready func()) error {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("%s: %w", addr, err)
		}
		return serveHTTP(ctx, ready, ln, &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second})
	})
}

// serveHTTP calls ready, then serves hs on ln until ctx ends, and shuts it
// down gracefully (2 s grace).
func serveHTTP(ctx context.Context, ready func(), ln net.Listener, hs *http.Server) error {
	stop := context.AfterFunc(ctx, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		hs.Shutdown(sctx)
	})
	defer stop()
	ready()
	if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
