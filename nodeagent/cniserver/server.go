// Package cniserver is the agent's end of the CNI event API: a gRPC server on
// a root-only Unix socket that turns the plugin's AddPod/DelPod calls into
// PodEvents for a Handler (the agent core decides and enrolls) and turns the
// Handler's answer back into an Outcome or a gRPC status the plugin reports.
package cniserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ambientd/ambientd/nodeagent/cniapi"
)

// PodEvent is one pod sandbox event as the runtime described it to the plugin.
type PodEvent struct {
	Name, Namespace string
	// UID may be empty: old runtimes do not pass K8S_POD_UID.
	UID              string
	InfraContainerID string
	// NetnsPath is the pod's network namespace; empty on a DEL whose
	// namespace is already gone.
	NetnsPath string
	// IPs are the pod's addresses from the chain's prevResult, with the
	// prefix length of their subnet.
	IPs []netip.Prefix
	// Interface is the pod-side interface name (CNI_IFNAME).
	Interface string
}

// Outcome is what HandleAdd did with a pod it did not fail.
type Outcome int

const (
	// OutcomeUnknown is the zero value; returning it with a nil error is a
	// Handler bug and fails the ADD.
	OutcomeUnknown Outcome = iota
	// Enrolled: in-pod rules applied and ztunnel acknowledged the pod.
	Enrolled
	// Pending: rules applied, ztunnel has not acknowledged yet; the agent
	// retries. The pod may start: its traffic is already captured.
	Pending
	// NotInMesh: the pod does not belong in the mesh; nothing was done.
	NotInMesh
)

func (o Outcome) String() string {
	switch o {
	case Enrolled:
		return "enrolled"
	case Pending:
		return "pending"
	case NotInMesh:
		return "not-in-mesh"
	default:
		return fmt.Sprintf("Outcome(%d)", int(o))
	}
}

// LogValue makes slog (whose JSON handler ignores String) log the name, not
// the number.
func (o Outcome) LogValue() slog.Value { return slog.StringValue(o.String()) }

func (o Outcome) proto() cniapi.Outcome {
	switch o {
	case Enrolled:
		return cniapi.Outcome_OUTCOME_ENROLLED
	case Pending:
		return cniapi.Outcome_OUTCOME_PENDING
	case NotInMesh:
		return cniapi.Outcome_OUTCOME_NOT_IN_MESH
	default:
		return cniapi.Outcome_OUTCOME_UNSPECIFIED
	}
}

// Handler decides about and enrolls pods; the agent core implements it.
// Calls are concurrent (one per plugin exec) and ctx carries the plugin's
// deadline.
type Handler interface {
	// HandleAdd returns the Outcome, or an error when the pod belongs in the
	// mesh but could not be captured: the plugin then fails the ADD with the
	// error's message and the runtime retries the sandbox. The status code
	// sent is codes.Internal, or the code of a gRPC status the error wraps
	// (status.Error), or DeadlineExceeded/Canceled for context errors.
	HandleAdd(ctx context.Context, ev PodEvent) (Outcome, error)
	// HandleDel is told about a torn-down sandbox. Its error is logged by the
	// plugin and never fails the DEL.
	HandleDel(ctx context.Context, ev PodEvent) error
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

// SocketPath is the path the server listens on.
func (s *Server) SocketPath() string { return s.cfg.SocketPath }

// Serving reports whether the socket is up and accepting calls.
func (s *Server) Serving() bool { return s.serving.Load() }

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
	ln, ino, err := listen(path)
	if err != nil {
		return err
	}

	gs := grpc.NewServer(
		grpc.Creds(peerCredentials{}),
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
	removeIfOurs(path, ino, s.log)
	return runErr
}

// listen replaces a stale socket at path and listens there with mode 0600.
// It returns the socket's inode so shutdown removes only its own socket, not
// one a newer agent already put in its place.
func listen(path string) (*net.UnixListener, fileID, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fileID{}, fmt.Errorf("cniserver: create socket directory: %w", err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fileID{}, fmt.Errorf("cniserver: refusing to replace %s: it is a %v, not a socket", path, fi.Mode().Type())
		}
		// A socket left behind by an agent that died: nothing can be
		// listening on it any more that we should defer to, since only one
		// agent runs per node and this is it.
		if err := os.Remove(path); err != nil {
			return nil, fileID{}, fmt.Errorf("cniserver: remove stale socket: %w", err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fileID{}, fmt.Errorf("cniserver: inspect socket path: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fileID{}, fmt.Errorf("cniserver: listen: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	// bind(2) applies the umask; tighten afterwards. A non-root process that
	// connects in between is still refused by the SO_PEERCRED check.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		os.Remove(path)
		return nil, fileID{}, fmt.Errorf("cniserver: chmod socket: %w", err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		ln.Close()
		os.Remove(path)
		return nil, fileID{}, fmt.Errorf("cniserver: stat socket: %w", err)
	}
	return ln, inode(fi), nil
}

// fileID identifies one file across a remove and re-create at the same path
// (inode numbers alone get reused at once on tmpfs).
type fileID struct {
	dev, ino uint64
	ctime    syscall.Timespec
}

func inode(fi os.FileInfo) fileID {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return fileID{dev: st.Dev, ino: st.Ino, ctime: st.Ctim}
	}
	return fileID{}
}

func removeIfOurs(path string, ino fileID, log *slog.Logger) {
	fi, err := os.Lstat(path)
	if err != nil {
		return
	}
	if inode(fi) != ino {
		log.Info("socket path now belongs to another server; leaving it", "socket", path)
		return
	}
	if err := os.Remove(path); err != nil {
		log.Warn("remove socket", "socket", path, "err", err)
	}
}

// AddPod implements cniapi.CNIEventsServer.
func (s *Server) AddPod(ctx context.Context, req *cniapi.AddPodRequest) (*cniapi.AddPodResponse, error) {
	ev, err := podEvent(req.GetPod(), true)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "AddPod: %v", err)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	start := time.Now()
	out, err := s.h.HandleAdd(ctx, ev)
	log := s.log.With("pod", ev.Namespace+"/"+ev.Name, "uid", ev.UID, "took", time.Since(start))
	if err != nil {
		st := toStatus(err)
		log.Warn("CNI ADD failed", "code", st.Code(), "err", st.Message())
		return nil, st.Err()
	}
	if out.proto() == cniapi.Outcome_OUTCOME_UNSPECIFIED {
		log.Error("handler returned no outcome and no error", "outcome", out.String())
		return nil, status.Errorf(codes.Internal, "agent handler returned %v without an error", out)
	}
	log.Info("CNI ADD handled", "outcome", out.String())
	return &cniapi.AddPodResponse{Outcome: out.proto(), Message: out.String()}, nil
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
		s.log.Warn("CNI DEL failed", "pod", ev.Namespace+"/"+ev.Name, "uid", ev.UID, "code", st.Code(), "err", st.Message())
		return nil, st.Err()
	}
	s.log.Debug("CNI DEL handled", "pod", ev.Namespace+"/"+ev.Name, "uid", ev.UID)
	return &cniapi.DelPodResponse{}, nil
}

// bound gives a call without a deadline the server's maximum.
func (s *Server) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.cfg.MaxCallTimeout)
}

func podEvent(p *cniapi.Pod, add bool) (PodEvent, error) {
	if p == nil {
		return PodEvent{}, errors.New("no pod in request")
	}
	if p.GetName() == "" || p.GetNamespace() == "" {
		return PodEvent{}, fmt.Errorf("pod name and namespace are required (got name=%q namespace=%q)", p.GetName(), p.GetNamespace())
	}
	if add && p.GetNetnsPath() == "" {
		return PodEvent{}, fmt.Errorf("pod %s/%s: netns path is required", p.GetNamespace(), p.GetName())
	}
	ev := PodEvent{
		Name: p.GetName(), Namespace: p.GetNamespace(), UID: p.GetUid(),
		InfraContainerID: p.GetInfraContainerId(), NetnsPath: p.GetNetnsPath(),
		Interface: p.GetInterface(),
	}
	for _, s := range p.GetIps() {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return PodEvent{}, fmt.Errorf("pod %s/%s: bad IP %q: %w", p.GetNamespace(), p.GetName(), s, err)
		}
		ev.IPs = append(ev.IPs, pfx)
	}
	return ev, nil
}

// toStatus keeps a gRPC status the handler chose and maps everything else.
func toStatus(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.New(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.New(codes.Canceled, err.Error())
	default:
		return status.New(codes.Internal, err.Error())
	}
}
