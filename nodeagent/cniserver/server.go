// Package cniserver is the agent's end of the CNI event API: a gRPC server on
// a root-only Unix socket that turns the plugin's AddPod/DelPod calls into
// PodEvents for a Handler (the agent's CNI edge decides and enrolls) and
// turns the Handler's answer back into an Outcome or a gRPC status the
// plugin reports.
package cniserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/unixsock"
)

func outcomeProto(o agent.Outcome) cniapi.Outcome {
	switch o {
	case agent.Enrolled:
		return cniapi.Outcome_OUTCOME_ENROLLED
	case agent.Pending:
		return cniapi.Outcome_OUTCOME_PENDING
	case agent.NotInMesh:
		return cniapi.Outcome_OUTCOME_NOT_IN_MESH
	case agent.SidecarCaptured:
		return cniapi.Outcome_OUTCOME_SIDECAR
	default:
		return cniapi.Outcome_OUTCOME_UNSPECIFIED
	}
}

// Handler decides about and enrolls pods; the agent's CNI edge
// (*agent.CNI) implements it.
// Calls are concurrent (one per plugin exec) and ctx carries the plugin's
// deadline.
type Handler interface {
	// HandleAdd returns the Outcome, or an error when the pod belongs in the
	// mesh but could not be captured: the plugin then fails the ADD with the
	// error's message and the runtime retries the sandbox. The status code
	// sent is mapped from the agent's domain error the error wraps (see
	// toStatus), DeadlineExceeded/Canceled for context errors, else Internal.
	HandleAdd(ctx context.Context, ev agent.PodEvent) (agent.Outcome, error)
	// HandleDel is told about a torn-down sandbox. Its error is logged by the
	// plugin and never fails the DEL.
	HandleDel(ctx context.Context, ev agent.PodEvent) error
}

// Config configures a Server. The zero value is usable.
type Config struct {
	// SocketPath defaults to cniapi.DefaultSocketPath.
	SocketPath string
	// MaxCallTimeout bounds a call whose caller set no deadline; default 2m.
	MaxCallTimeout time.Duration
	// ShutdownGrace is how long Run waits for calls in flight when ctx is
	// done before cutting them off; default 5s.
	ShutdownGrace time.Duration
	// Istio counts ADDs under Istio's istio_cni_plugin_requests_total
	// (nil: not counted; see istioResponseCode).
	Istio *istiometrics.Metrics
}

// Server serves CNIEvents and grpc.health.v1 on a Unix socket.
type Server struct {
	cfg     Config
	h       Handler
	log     *slog.Logger
	serving atomic.Bool
	started atomic.Bool

	cniapi.UnimplementedCNIEventsServer
}

// New returns a Server that hands events to h. A nil log discards logs.
func New(cfg Config, h Handler, log *slog.Logger) *Server {
	if cfg.SocketPath == "" {
		cfg.SocketPath = cniapi.DefaultSocketPath
	}
	if cfg.MaxCallTimeout <= 0 {
		cfg.MaxCallTimeout = 2 * time.Minute
	}
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = 5 * time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{cfg: cfg, h: h, log: log.With("component", "cniserver")}
}

// Serving reports whether the socket is up and accepting calls.
func (s *Server) Serving() bool { return s.serving.Load() }

// readBufferSize is each connection's read buffer: the largest call (an
// AddPod with its CNI result) fits many times over.
const readBufferSize = 4 << 10

// Run creates the socket directory, replaces a stale socket left by a
// previous agent, listens with mode 0600, and serves until ctx is done; then
// it drains calls in flight (up to ShutdownGrace) and removes the socket. It
// returns nil after ctx is done, or the error that stopped it. Run may be
// called once.
func (s *Server) Run(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("cniserver: Run called twice")
	}
	path := s.cfg.SocketPath
	ln, sock, err := unixsock.Listen(path, "unix", 0o600)
	if err != nil {
		return fmt.Errorf("cniserver: %w", err)
	}

	gs := grpc.NewServer(
		grpc.Creds(peerCredentials{}),
		// Every plugin process opens its own connection and sends a few
		// hundred bytes. gRPC's 32 KiB read buffer per connection made a
		// burst of ADDs hold megabytes at once (its write buffers are
		// already shared between flushes).
		grpc.ReadBufferSize(readBufferSize),
		grpc.ChainUnaryInterceptor(s.unaryRootOnly),
		grpc.ChainStreamInterceptor(s.streamRootOnly),
	)
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus(cniapi.HealthService, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(gs, hs)
	cniapi.RegisterCNIEventsServer(gs, s)

	serveErr := make(chan error, 1)
	s.serving.Store(true)
	go func() { serveErr <- gs.Serve(ln) }()
	s.log.Info("serving CNI events", "socket", path)

	var runErr error
	select {
	case <-ctx.Done():
	case err := <-serveErr:
		runErr = fmt.Errorf("cniserver: serve %s: %w", path, err)
	}
	s.serving.Store(false)
	hs.Shutdown()

	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	timer := time.NewTimer(s.cfg.ShutdownGrace)
	select {
	case <-stopped:
	case <-timer.C:
		s.log.Warn("CNI calls still in flight after shutdown grace; cutting them off", "grace", s.cfg.ShutdownGrace)
		gs.Stop()
		<-stopped
	}
	timer.Stop()
	sock.RemoveIfOurs(s.log)
	return runErr
}

// AddPod implements cniapi.CNIEventsServer.
func (s *Server) AddPod(ctx context.Context, req *cniapi.AddPodRequest) (*cniapi.AddPodResponse, error) {
	start := time.Now()
	ev, err := podEvent(req.GetPod(), true)
	if err != nil {
		s.cfg.Istio.PluginRequest(http.StatusBadRequest)
		return nil, status.Errorf(codes.InvalidArgument, "AddPod: %v", err)
	}
	ev.Received = start
	if t := req.GetTimings(); t != nil {
		ev.Plugin = agent.PluginTimings{Init: time.Duration(t.GetInitNanos()), Config: time.Duration(t.GetConfigNanos())}
		if t.GetCallStartUnixNano() > 0 {
			ev.Plugin.CallStart = time.Unix(0, t.GetCallStartUnixNano())
		}
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	out, err := s.h.HandleAdd(ctx, ev)
	if code, counted := istioResponseCode(out, err); counted {
		s.cfg.Istio.PluginRequest(code)
	}
	took := time.Since(start)
	log := s.log.With("namespace", ev.Namespace, "pod", ev.Name, "uid", ev.UID, "took", took)
	if err != nil {
		st := toStatus(err)
		log.Warn("CNI ADD failed", "code", st.Code(), "error", st.Message())
		return nil, st.Err()
	}
	if outcomeProto(out) == cniapi.Outcome_OUTCOME_UNSPECIFIED {
		log.Error("handler returned no outcome and no error", "outcome", out.String())
		return nil, status.Errorf(codes.Internal, "agent handler returned %v without an error", out)
	}
	log.Info("CNI ADD handled", "outcome", out.String())
	return &cniapi.AddPodResponse{Outcome: outcomeProto(out), Message: out.String(), AgentNanos: int64(took)}, nil
}

// istioResponseCode is the HTTP status Istio's node agent would have
// answered an ADD with (cni/pkg/nodeagent/cni-watcher.go): 200 when the pod
// was handled, 400 for a request naming no possible pod or netns, 500 when
// the pod could not be added. Istio's plugin calls its agent only for pods
// in the ambient mesh, so an ADD of a pod out of the mesh or of a sidecar
// pod is not counted (counted false); a failure always is.
func istioResponseCode(out agent.Outcome, err error) (code int, counted bool) {
	switch {
	case err != nil && toStatus(err).Code() == codes.InvalidArgument:
		return http.StatusBadRequest, true
	case err != nil, outcomeProto(out) == cniapi.Outcome_OUTCOME_UNSPECIFIED:
		return http.StatusInternalServerError, true
	case out == agent.NotInMesh, out == agent.SidecarCaptured:
		return 0, false
	}
	return http.StatusOK, true
}

// DelPod implements cniapi.CNIEventsServer.
func (s *Server) DelPod(ctx context.Context, req *cniapi.DelPodRequest) (*cniapi.DelPodResponse, error) {
	ev, err := podEvent(req.GetPod(), false)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "DelPod: %v", err)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.h.HandleDel(ctx, ev); err != nil {
		st := toStatus(err)
		s.log.Warn("CNI DEL failed", "namespace", ev.Namespace, "pod", ev.Name, "uid", ev.UID, "code", st.Code(), "error", st.Message())
		return nil, st.Err()
	}
	s.log.Debug("CNI DEL handled", "namespace", ev.Namespace, "pod", ev.Name, "uid", ev.UID)
	return &cniapi.DelPodResponse{}, nil
}

// bound gives a call without a deadline the server's maximum.
func (s *Server) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.cfg.MaxCallTimeout)
}

func podEvent(p *cniapi.Pod, add bool) (agent.PodEvent, error) {
	if p == nil {
		return agent.PodEvent{}, errors.New("no pod in request")
	}
	if p.GetName() == "" || p.GetNamespace() == "" {
		return agent.PodEvent{}, fmt.Errorf("pod name and namespace are required (got name=%q namespace=%q)", p.GetName(), p.GetNamespace())
	}
	if add && p.GetNetnsPath() == "" {
		return agent.PodEvent{}, fmt.Errorf("pod %s/%s: netns path is required", p.GetNamespace(), p.GetName())
	}
	ev := agent.PodEvent{
		Name: p.GetName(), Namespace: p.GetNamespace(), UID: p.GetUid(),
		InfraContainerID: p.GetInfraContainerId(), NetnsPath: p.GetNetnsPath(),
		Interface: p.GetInterface(),
	}
	for _, s := range p.GetIps() {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return agent.PodEvent{}, fmt.Errorf("pod %s/%s: bad IP %q: %w", p.GetNamespace(), p.GetName(), s, err)
		}
		ev.IPs = append(ev.IPs, pfx)
	}
	return ev, nil
}

// codeOf maps the agent's domain errors to the gRPC codes the plugin acts
// on: Unavailable tells it to let the runtime try again later.
var codeOf = []struct {
	err  error
	code codes.Code
}{
	{agent.ErrPodUnknown, codes.NotFound},
	{agent.ErrAPIUnavailable, codes.Unavailable},
	{agent.ErrInvalidPod, codes.InvalidArgument},
	{agent.ErrNetnsUnusable, codes.InvalidArgument},
	{agent.ErrNotCaptured, codes.Internal},
	{agent.ErrPending, codes.Unavailable},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
}

// toStatus turns a handler error into the status the plugin gets. This is
// the one place agent errors become gRPC codes.
func toStatus(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	for _, m := range codeOf {
		if errors.Is(err, m.err) {
			return status.New(m.code, err.Error())
		}
	}
	return status.New(codes.Internal, err.Error())
}
