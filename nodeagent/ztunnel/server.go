// Package ztunnel is the agent's side of the ZDS protocol: it listens on the
// ztunnel socket, greets every ztunnel that connects with a snapshot of the
// pods the agent knows, and then streams workload adds and deletes to it.
//
// Adds go to the newest connection only, deletes to all of them: during a
// rolling ztunnel upgrade the old instance keeps serving the pods it already
// has, the new one takes every new pod. The protocol has no request ids, so
// each connection has exactly one request in flight, owned by one goroutine.
package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/time/rate"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/unixsock"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

var (
	// ErrNoZtunnel means no ztunnel is connected, so the request went nowhere.
	ErrNoZtunnel = errors.New("no ztunnel connected")
	// ErrConnBroken means the connection failed or timed out mid-request; it
	// has been dropped. Whether ztunnel applied the request is unknown.
	ErrConnBroken = errors.New("ztunnel connection broken")
)

// NackError is ztunnel's answer when it refused a request.
type NackError struct {
	Op, UID, Message string
}

func (e *NackError) Error() string {
	return fmt.Sprintf("ztunnel refused %s of workload %s: %s", e.Op, e.UID, e.Message)
}

// Workload identifies a pod to ztunnel.
type Workload struct {
	UID, Name, Namespace, ServiceAccount string
}

// SnapshotEntry is one pod of the snapshot. A nil Netns sends Keep instead of
// Add. The server never closes these handles (the registry owns them); the
// kernel duplicates the descriptor for ztunnel.
type SnapshotEntry struct {
	Workload Workload
	Netns    *podnetns.Handle
}

// SnapshotSource is what the server needs of the agent (*agent.Agent
// implements it): the pods to send a newly connected ztunnel, and where to
// report what a ztunnel refused or left behind. None of its methods may
// block: the server calls them mid-snapshot and as a connection closes,
// while the agent's own syncs may be waiting on that connection.
type SnapshotSource interface {
	// Snapshot lists the pods to send a newly connected ztunnel.
	Snapshot() []SnapshotEntry
	// SnapshotRefused is called for each entry ztunnel refused, before the
	// snapshot is acked (before subscribers of SubscribeSnapshotAcked are
	// signalled for that connection).
	SnapshotRefused(uid string, err error)
	// Readd asks the source to re-add a pod a closed connection held to
	// the newest one itself, through its own serialized path (the agent's
	// per-pod sync, under the pod's lock), so that one writer decides what
	// ztunnel should carry and a re-add's Add can never land after a Del
	// of the same pod. report, if the source calls it, is told the result
	// of the Add it sent for the re-add.
	Readd(uid string, report func(error))
}

// Config tunes the server; zero fields take the defaults in brackets.
type Config struct {
	SocketPath        string        // [ztunnelproto.DefaultSocketPath]
	SocketMode        os.FileMode   // permission bits of the socket file [0600]
	AckTimeout        time.Duration // per request, from the start of its send to its ack [5s]
	HelloTimeout      time.Duration // from accept to ztunnel's hello [5s]
	KeepaliveInterval time.Duration // renewal period of the idle read [5s]
	// ProbeInterval: a connection with no request for this long gets a
	// probe — a Del of a uid no pod has, which ztunnel acks and which
	// changes nothing — so a ztunnel that hangs with its socket open is
	// found within ProbeInterval + AckTimeout [10s]. ZDS has no heartbeat.
	ProbeInterval time.Duration
	AcceptRate    rate.Limit // new connections per second [10]
	AcceptBurst   int        // [5]

	// AllowedUIDs are the uids a ztunnel may run as [root only]. Every
	// peer's uid is read from the kernel (SO_PEERCRED) at accept; any other
	// peer is logged, counted and closed before anything is sent to it —
	// whoever is served gets every pod's network namespace.
	AllowedUIDs []uint32
}

func (c Config) withDefaults() Config {
	if c.SocketPath == "" {
		c.SocketPath = zp.DefaultSocketPath
	}
	if c.SocketMode == 0 {
		c.SocketMode = 0o600
	}
	if c.AckTimeout <= 0 {
		c.AckTimeout = 5 * time.Second
	}
	if c.HelloTimeout <= 0 {
		c.HelloTimeout = 5 * time.Second
	}
	if c.KeepaliveInterval <= 0 {
		c.KeepaliveInterval = 5 * time.Second
	}
	if c.ProbeInterval <= 0 {
		c.ProbeInterval = DefaultProbeInterval
	}
	if c.AcceptRate <= 0 {
		c.AcceptRate = 10
	}
	if c.AcceptBurst <= 0 {
		c.AcceptBurst = 5
	}
	if len(c.AllowedUIDs) == 0 {
		c.AllowedUIDs = []uint32{0}
	}
	return c
}

// Status is a point-in-time view for health checks and the status command.
type Status struct {
	Connections   int  // live ztunnel connections (hello received)
	SnapshotAcked bool // the newest connection has acked its SnapshotSent
	// Serving counts the live connections that acked their SnapshotSent:
	// ztunnels that carry the node's pods. During a rolling upgrade the old
	// one serves while the new one is still taking its snapshot.
	Serving int
	// Unresponsive: no connection serves, and the last one that did was
	// dropped because ztunnel did not answer within the ack timeout (a
	// hung ztunnel: its process and socket may still be there).
	Unresponsive bool
}

// DefaultProbeInterval is Config.ProbeInterval's default.
const DefaultProbeInterval = 10 * time.Second

// Server is the agent's ztunnel server. Create it with NewServer and start it
// with Run; AddWorkload and friends may be called before, during and after.
type Server struct {
	cfg     Config
	log     *slog.Logger
	metrics *Metrics

	// now is the clock of ack deadlines and afterSend, when set, runs after
	// each request's send: tests use them to make a send "take" a given
	// time without waiting for it.
	now       func() time.Time
	afterSend func(op, uid string)

	mu    sync.Mutex
	conns []*zconn // oldest first; the last one gets the adds
	subs  map[int]chan struct{}
	// statusSubs are signalled on every change of Status.
	statusSubs map[int]chan struct{}
	nextID     uint64
	subID      int
	// hung: the last serving connection to close was dropped for not
	// answering (Status.Unresponsive); cleared when one serves again.
	hung bool
}

// NewServer returns a server; Run serves it with the snapshots of a source.
func NewServer(cfg Config, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		cfg:        cfg.withDefaults(),
		log:        log.With("component", "ztunnel-server"),
		subs:       map[int]chan struct{}{},
		statusSubs: map[int]chan struct{}{},
		now:        time.Now,
	}
	// The connections gauge is read from the list itself, under its lock,
	// when scraped: no copy of the count to keep in step.
	s.metrics = newMetrics(func() int {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.conns)
	})
	return s
}

// Metrics returns the server's Prometheus collectors for the agent to register.
func (s *Server) Metrics() *Metrics { return s.metrics }

// Run listens on the socket and serves ztunnel connections, each greeted
// with a snapshot from src, until ctx is done;
// then it closes every connection, removes the socket and returns nil. It
// creates the socket's directory and replaces a stale socket file. On
// shutdown it removes the socket file only if it is still the one it created,
// so a newer agent's socket at the same path survives the old one exiting.
//
// Temporary accept errors (out of descriptors or memory) are logged and
// retried with a backoff of 5ms doubling to 1s. Any other accept error stops
// the server: it closes every connection, removes the socket and returns the
// error.
func (s *Server) Run(ctx context.Context, src SnapshotSource) error {
	if src == nil {
		return errors.New("ztunnel server: no snapshot source")
	}
	l, sock, err := unixsock.Listen(s.cfg.SocketPath, "unixpacket", s.cfg.SocketMode)
	if err != nil {
		return fmt.Errorf("ztunnel socket: %w", err)
	}
	s.log.Info("listening for ztunnel", "socket", s.cfg.SocketPath, "mode", s.cfg.SocketMode.String())

	// Connections live until ctx is done or accepting fails for good.
	connCtx, closeConns := context.WithCancel(ctx)
	defer closeConns()
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	limiter := rate.NewLimiter(s.cfg.AcceptRate, s.cfg.AcceptBurst)
	var acceptErr error
	var backoff time.Duration
	for {
		if err := limiter.Wait(ctx); err != nil {
			break // ctx done
		}
		uc, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			if temporaryAcceptError(err) {
				s.metrics.retries.Inc()
				backoff = min(max(2*backoff, minAcceptBackoff), maxAcceptBackoff)
				s.log.Warn("accept on ztunnel socket failed; retrying", "socket", s.cfg.SocketPath, "error", err, "retry_in", backoff)
				if !sleepCtx(ctx, backoff) {
					break
				}
				continue
			}
			acceptErr = fmt.Errorf("accept on ztunnel socket %s: %w", s.cfg.SocketPath, err)
			break
		}
		backoff = 0
		s.metrics.accepted.Inc()
		if !s.allowedPeer(uc) {
			uc.Close()
			continue
		}
		wg.Go(func() { s.serveConn(connCtx, uc, src) })
	}
	l.Close()
	sock.RemoveIfOurs(s.log)
	if acceptErr != nil {
		s.log.Error("ztunnel server stopping; closing every connection", "error", acceptErr)
		closeConns()
	}
	wg.Wait()
	return acceptErr
}

// allowedPeer reports whether the process that connected runs as an
// allowed uid; a refusal is logged and counted. The socket's mode keeps
// most processes out already; this also stops one that gets past it (a
// group member of a widened mode, or a non-root process with
// CAP_DAC_OVERRIDE).
func (s *Server) allowedPeer(uc *net.UnixConn) bool {
	cred, err := unixsock.PeerCred(uc)
	if err != nil {
		s.metrics.refused.Inc()
		s.log.Warn("refused a connection to the ztunnel socket: cannot read its peer's credentials", "error", err)
		return false
	}
	if slices.Contains(s.cfg.AllowedUIDs, cred.Uid) {
		return true
	}
	s.metrics.refused.Inc()
	s.log.Warn("refused a connection to the ztunnel socket from a process whose uid is not an allowed ztunnel uid",
		"uid", cred.Uid, "gid", cred.Gid, "pid", cred.Pid, "allowed_uids", s.cfg.AllowedUIDs)
	return false
}

const (
	minAcceptBackoff = 5 * time.Millisecond
	maxAcceptBackoff = time.Second
)

// temporaryAcceptError reports whether accept may succeed if retried later:
// the process or system ran out of descriptors or memory, or the connection
// went away before we accepted it.
func temporaryAcceptError(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOMEM, syscall.ENOBUFS, syscall.ECONNABORTED, syscall.EINTR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// sleepCtx sleeps for d; false if ctx was done first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// AddWorkload sends an Add with netns to the newest connection and waits for
// its ack. If that connection is still sending its snapshot, the Add is queued
// behind it. Errors: ErrNoZtunnel, *NackError, or one wrapping ErrConnBroken
// (which includes an ack timeout), or ctx's error.
func (s *Server) AddWorkload(ctx context.Context, w Workload, netns *podnetns.Handle) error {
	if netns == nil {
		return fmt.Errorf("add workload %s: no netns file", w.UID)
	}
	c := s.newest()
	if c == nil {
		s.metrics.requests.WithLabelValues("add", "no_ztunnel").Inc()
		return fmt.Errorf("add workload %s: %w", w.UID, ErrNoZtunnel)
	}
	return c.do(ctx, addReq(w, netns))
}

// DelWorkload sends a Del to every connection and waits for all acks. With no
// connection it returns nil: a ztunnel that connects later gets a snapshot
// without the pod. A connection that breaks meanwhile is not an error either,
// for the same reason; a refusal is a *NackError.
//
// A ztunnel that connects while the Dels are out may have been sent a
// snapshot that still holds the pod (the caller forgets it only after this
// returns), so once the acks are in, the Del also goes to every connection
// registered since it started, until no new one has appeared. Such a
// connection gets it after its SnapshotSent, like any request. ztunnel acks a
// Del of a pod it does not know, so the extra Dels are harmless.
func (s *Server) DelWorkload(ctx context.Context, uid string) error {
	var keep []error
	conns, seen := s.connsAfter(0)
	for len(conns) > 0 {
		errs := make([]error, len(conns))
		var wg sync.WaitGroup
		for i, c := range conns {
			wg.Go(func() { errs[i] = c.do(ctx, delReq(uid)) })
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil && !errors.Is(err, ErrConnBroken) {
				keep = append(keep, err)
			}
		}
		if ctx.Err() != nil {
			break
		}
		conns, seen = s.connsAfter(seen)
	}
	return errors.Join(keep...)
}
