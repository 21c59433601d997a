package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/procfs"
	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/cniserver"
	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// Config configures a Process. Zero socket paths take the servers' defaults;
// an empty address disables that listener.
type Config struct {
	Agent                    agent.Config
	ZtunnelSocket, CNISocket string
	// ZtunnelSocketMode is the ztunnel socket's permission bits (0: 0600).
	ZtunnelSocketMode os.FileMode
	// ZtunnelProbeInterval: an idle ztunnel connection is probed this
	// often, so a hung ztunnel is found (ztunnel.Config.ProbeInterval;
	// 0: ztunnel.DefaultProbeInterval).
	ZtunnelProbeInterval time.Duration
	// ZtunnelAllowedUIDs are the uids ztunnel may connect as (nil: root).
	ZtunnelAllowedUIDs []uint32
	// HealthAddr serves /healthz and /readyz; MetricsAddr serves /metrics.
	HealthAddr, MetricsAddr string
	// PprofAddr serves Go's profiling endpoints under /debug/pprof/
	// (empty: off).
	PprofAddr string
	// NodeReady configures the node condition and the taint controller
	// (its NodeName defaults to Agent.NodeName).
	NodeReady nodeready.Config
	// PluginInstalled is the node condition's "CNI plugin installed" check
	// (nil: PluginInConfDir of CNIConfDir for cniapi.PluginType).
	PluginInstalled func() error
	// InstallLease, with --install-cni, is the last install lease write's
	// error (nodeready.Inputs.InstallLease).
	InstallLease func() error
	// RequestMetrics, when set, counts the client's requests (its
	// transport wrapped by it): exported with the agent's metrics and as
	// the last minute's count in `ambientd status`.
	RequestMetrics *kube.RequestMetrics
	// CNIConfDir is the container runtime's CNI config dir, as mounted
	// (required without PluginInstalled).
	CNIConfDir string
	// AdminSocket serves `ambientd status` (admin.DefaultSocketPath when
	// empty). StatusProviders add what other parts know to its answers.
	AdminSocket     string
	StatusProviders []admin.Provider
	Version         string
	// Components are further parts of the process (the CNI installer),
	// started before all others and stopped after them.
	Components []Component
	// Sidecar configures sidecar mode and its repair controller.
	Sidecar SidecarConfig
	// IstioMetrics also exports Istio's istio-cni metric names, counted
	// from the same events (istiometrics; docs/metrics.md).
	IstioMetrics bool
}

// Process is the whole node agent process: the agent core, its two socket
// servers, the node readiness controller, the status writer and the HTTP
// listeners, over one set of shared informers and one Event broadcaster.
type Process struct {
	cfg       Config
	log       *slog.Logger
	informers *kube.Informers
	events    *kube.Events
	absent    *absenceReport
	agent     *agent.Agent
	zt        *ztunnel.Server
	cni       *cniserver.Server
	ready     *nodeready.Controller
	// sidecar are sidecar mode's parts (run after the agent starts).
	sidecar []Component
	// pluginInstalled is shared by the node condition and /readyz.
	pluginInstalled func() error
	// inputs are readiness's (the node condition's, /readyz's).
	inputs nodeready.Inputs
	// istio counts Istio's names (nil: off).
	istio *istiometrics.Metrics
}

// New builds the node agent. What several parts share is built once, here:
// the informers, the Event broadcaster, and the ztunnel server the agent
// talks to — the agent is the server's snapshot source, handed to its Run,
// so neither waits for the other to exist.
func New(cfg Config, client kube.Interface, rules agent.Rules, log *slog.Logger) (*Process, error) {
	informers := kube.NewInformers(client, cfg.Agent.NodeName)
	events := kube.NewEvents(client, cfg.Agent.NodeName)
	zs := ztunnel.NewServer(ztunnel.Config{SocketPath: cfg.ZtunnelSocket, SocketMode: cfg.ZtunnelSocketMode, AllowedUIDs: cfg.ZtunnelAllowedUIDs, ProbeInterval: cfg.ZtunnelProbeInterval}, log)
	var im *istiometrics.Metrics
	if cfg.IstioMetrics {
		im = istiometrics.New()
	}
	a, err := agent.New(cfg.Agent, agent.Deps{
		Client: client, Informers: informers, Recorder: events.Recorder(),
		Ztunnel: zs, Rules: rules, Registry: registry.New(), Log: log, Istio: im,
	})
	if err != nil {
		return nil, err
	}
	if err := a.Metrics().Register(zs.Metrics()); err != nil {
		return nil, fmt.Errorf("register ztunnel metrics: %w", err)
	}
	if cfg.PluginInstalled == nil {
		if cfg.CNIConfDir == "" {
			return nil, errors.New("daemon: a CNI config dir (or a plugin check) is required")
		}
		cfg.PluginInstalled = pluginCheck(cfg.CNIConfDir, cniapi.PluginType, time.Now())
	}
	if err := registerPluginCheck(&cfg, a.Metrics()); err != nil {
		return nil, err
	}
	if rm := cfg.RequestMetrics; rm != nil {
		if err := rm.Register(a.Metrics()); err != nil {
			return nil, fmt.Errorf("register API request metrics: %w", err)
		}
		cfg.StatusProviders = append(cfg.StatusProviders, func(st *admin.NodeStatus) {
			n := rm.LastMinute(time.Now())
			st.APIRequestsLastMinute = &n
		})
	}
	edge := agent.NewCNI(a)
	sc, err := sidecarParts(cfg, client, rules, a, edge, informers, events, log)
	if err != nil {
		return nil, err
	}
	absent, err := newAbsenceReport(cfg.CNISocket, cfg.Agent.NodeName, events.Recorder(), a.Metrics(), log)
	if err != nil {
		return nil, err
	}
	cs := cniserver.New(cniserver.Config{SocketPath: cfg.CNISocket, Istio: im}, edge, log)
	// istio_cni_installs_total only with --install-cni (InstallLease is
	// set then): nothing else installs.
	if err := im.Register(a.Metrics(), istiometrics.Sources{
		ZtunnelConnections: func() int { return zs.Status().Connections },
		PluginInstalled:    cfg.PluginInstalled,
		Installer:          cfg.InstallLease != nil,
	}); err != nil {
		return nil, fmt.Errorf("register Istio's metric names: %w", err)
	}
	n := &Process{absent: absent, cfg: cfg, log: log, informers: informers, events: events, agent: a, zt: zs, cni: cs, sidecar: sc, pluginInstalled: cfg.PluginInstalled, istio: im}
	if err := n.buildReadiness(client, informers, events, zs, cs); err != nil {
		return nil, err
	}
	return n, nil
}

// buildReadiness builds the node readiness controller over the inputs of
// readiness (one definition, nodeready.Compute, for the node condition,
// /readyz and `ambientd status`) and adds its view to `ambientd status`.
func (n *Process) buildReadiness(client kube.Interface, informers *kube.Informers, events *kube.Events, zs *ztunnel.Server, cs *cniserver.Server) error {
	nrCfg := n.cfg.NodeReady
	if nrCfg.NodeName == "" {
		nrCfg.NodeName = n.cfg.Agent.NodeName
	}
	if n.cfg.Agent.ZtunnelGrace > 0 {
		// The agent announces a ztunnel outage on the node itself, with
		// the pods it took out (agent.EventZtunnelUnavailable).
		nrCfg.AnnouncedElsewhere = append(nrCfg.AnnouncedElsewhere, nodeready.ZtunnelReasons()...)
	}
	// The inputs of readiness: one definition (nodeready.Compute) for the
	// node condition, /readyz and `ambientd status`.
	n.inputs = nodeready.Inputs{
		PluginInstalled: n.pluginInstalled,
		AgentStarted:    n.agent.Started,
		Ztunnel: func() nodeready.ZtunnelState {
			st := zs.Status()
			return nodeready.ZtunnelState{Connected: st.Connections > 0, SnapshotAcked: st.SnapshotAcked, Unresponsive: st.Unresponsive}
		},
		CNIServing:   cs.Serving,
		InstallLease: n.cfg.InstallLease,
	}
	var err error
	n.ready, err = nodeready.New(nrCfg, nodeready.Deps{
		Client:   client,
		Node:     informers.Node,
		Recorder: events.Recorder(),
		Log:      n.log,
		Inputs:   n.inputs,
		Started:  processStart(n.log),
	})
	if err != nil {
		return err
	}
	if err := n.agent.Metrics().Register(n.ready.Metrics()); err != nil {
		return fmt.Errorf("register node readiness metrics: %w", err)
	}
	// `ambientd status` shows the node condition and the taint as the
	// readiness controller last saw them.
	taintKey := nrCfg.TaintKey
	if taintKey == "" {
		taintKey = nodeready.DefaultTaintKey
	}
	n.cfg.StatusProviders = append(n.cfg.StatusProviders, func(st *admin.NodeStatus) {
		rs := n.ready.Status()
		st.NodeReadiness = string(rs.Condition)
		if rs.Condition != corev1.ConditionTrue && rs.Reason != "" {
			st.Readiness = append(st.Readiness, rs.Reason+": "+rs.Message)
		}
		st.Taint = "untainted"
		if rs.TaintPresent {
			st.Taint = "tainted (" + taintKey + ")"
		}
	})
	return nil
}

// Istio is the counter set of Istio's metric names (nil when
// Config.IstioMetrics is off), for the parts built outside the daemon (the
// CNI installer: InstallCNI.CountInstalls).
func (n *Process) Istio() *istiometrics.Metrics { return n.istio }

// processStart is when this process started, as the kernel recorded it
// (/proc/self/stat, to the clock tick); now when that cannot be read.
func processStart(log *slog.Logger) time.Time {
	p, err := procfs.Self()
	if err == nil {
		var st procfs.ProcStat
		if st, err = p.Stat(); err == nil {
			var secs float64
			if secs, err = st.StartTime(); err == nil {
				return time.Unix(0, int64(secs*float64(time.Second)))
			}
		}
	}
	log.Warn("cannot read the process's start time; the node's time to mesh-ready counts from now", "error", err)
	return time.Now()
}

// runNodeReady runs the node readiness controller, re-evaluated at once
// whenever a ztunnel connects, goes or acks its snapshot.
func (n *Process) runNodeReady(ctx context.Context) error {
	changed, unsubscribe := n.zt.SubscribeStatus()
	defer unsubscribe()
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-changed:
				n.ready.Notify()
			}
		}
	})
	return n.ready.Run(ctx)
}

// components lists the parts of the process in start order (see Run):
// cfg.Components, the Event broadcaster, the listeners (a bad address fails
// the start), the status writer, the informers (started once every part
// added its handlers), the agent (ready once its registry is rebuilt), then
// the servers that feed it.
func (n *Process) components() []Component {
	cs := slices.Clone(n.cfg.Components)
	cs = append(cs, Func("event broadcaster", n.events.Run), Func("absence report", n.absent.Run))
	if n.cfg.HealthAddr != "" {
		cs = append(cs, HTTP("--health-addr server", n.cfg.HealthAddr, n.healthHandler()))
	}
	if n.cfg.MetricsAddr != "" {
		cs = append(cs, HTTP("--metrics-addr server", n.cfg.MetricsAddr, promhttp.HandlerFor(n.agent.Metrics(), promhttp.HandlerOpts{})))
	}
	if n.cfg.PprofAddr != "" {
		cs = append(cs, HTTP("--pprof-addr server", n.cfg.PprofAddr, pprofHandler()))
	}
	cs = append(cs, n.sidecar...)
	return append(cs,
		n.adminServer(),
		Func("status writer", n.agent.RunStatusWriter),
		Func("informers", func(ctx context.Context) error {
			n.informers.Start(ctx.Done())
			<-ctx.Done()
			n.informers.Shutdown()
			return nil
		}),
		Func("node readiness", n.runNodeReady),
		Staged("agent", func(ctx context.Context, ready func()) error {
			return n.agent.Run(ctx, func() { ready(); n.ready.Notify() }) // caches synced
		}),
		Func("drift repair", n.agent.RunDrift),
		Func("ztunnel server", func(ctx context.Context) error { return n.zt.Run(ctx, n.agent) }),
		Func("CNI server", n.cni.Run),
	)
}

// Run runs the node agent until ctx ends (nil) or a part fails (its error).
func (n *Process) Run(ctx context.Context) error {
	return Run(ctx, n.log.With("component", "daemon"), n.components()...)
}

// Ready is /readyz: the node's readiness for the mesh as the node
// condition computes it (nodeready.Compute: our plugin in the runtime's CNI
// config, caches synced and registry rebuilt, a ztunnel connected that
// acked its snapshot, the CNI socket serving), now rather than as last
// written. The error lists every failed check.
func (n *Process) Ready() error { return nodeready.Compute(n.inputs).Err() }

func (n *Process) healthHandler() http.Handler {
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
