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
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// DefaultSocketPath is where ztunnel (and istio-cni) expect the agent.
const DefaultSocketPath = "/var/run/ztunnel/ztunnel.sock"

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
// Add. The server never closes these files (the registry owns them); the
// kernel duplicates the descriptor for ztunnel.
type SnapshotEntry struct {
	Workload Workload
	Netns    *os.File
}

// SnapshotSource lists the pods to send to a newly connected ztunnel.
type SnapshotSource interface {
	Snapshot() []SnapshotEntry
}

// Config tunes the server; zero fields take the defaults in brackets.
type Config struct {
	SocketPath        string        // [DefaultSocketPath]
	AckTimeout        time.Duration // per request, from send to ack [5s]
	HelloTimeout      time.Duration // from accept to ztunnel's hello [5s]
	KeepaliveInterval time.Duration // renewal period of the idle read [5s]
	AcceptRate        rate.Limit    // new connections per second [10]
	AcceptBurst       int           // [5]
}

func (c Config) withDefaults() Config {
	if c.SocketPath == "" {
		c.SocketPath = DefaultSocketPath
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
	if c.AcceptRate <= 0 {
		c.AcceptRate = 10
	}
	if c.AcceptBurst <= 0 {
		c.AcceptBurst = 5
	}
	return c
}

// Status is a point-in-time view for health checks and the status command.
type Status struct {
	Connections   int  // live ztunnel connections (hello received)
	SnapshotAcked bool // the newest connection has acked its SnapshotSent
}

// Server is the agent's ztunnel server. Create it with NewServer and start it
// with Run; AddWorkload and friends may be called before, during and after.
type Server struct {
	cfg     Config
	src     SnapshotSource
	log     *slog.Logger
	metrics *Metrics

	mu     sync.Mutex
	conns  []*zconn // oldest first; the last one gets the adds
	subs   map[int]chan struct{}
	nextID uint64
	subID  int
}

// NewServer returns a server that takes snapshots from src.
func NewServer(cfg Config, src SnapshotSource, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{
		cfg:     cfg.withDefaults(),
		src:     src,
		log:     log.With("component", "ztunnel-server"),
		metrics: newMetrics(),
		subs:    map[int]chan struct{}{},
	}
}

// Metrics returns the server's Prometheus collectors for the agent to register.
func (s *Server) Metrics() *Metrics { return s.metrics }

// Run listens on the socket and serves ztunnel connections until ctx is done;
// then it closes every connection, removes the socket and returns nil. It
// creates the socket's directory and replaces a stale socket file.
func (s *Server) Run(ctx context.Context) error {
	l, err := listen(s.cfg.SocketPath)
	if err != nil {
		return err
	}
	s.log.Info("listening for ztunnel", "socket", s.cfg.SocketPath)

	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	limiter := rate.NewLimiter(s.cfg.AcceptRate, s.cfg.AcceptBurst)
	var acceptErr error
	for {
		if err := limiter.Wait(ctx); err != nil {
			break // ctx done
		}
		uc, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() == nil {
				acceptErr = fmt.Errorf("accept on ztunnel socket %s: %w", s.cfg.SocketPath, err)
			}
			break
		}
		s.metrics.accepted.Inc()
		wg.Go(func() { s.serveConn(ctx, uc) })
	}
	l.Close() // unlinks the socket file
	wg.Wait()
	return acceptErr
}

// listen creates dir and socket, replacing a socket file left by a previous
// agent. Anything else at that path is an error: never delete a user's file.
func listen(path string) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("create ztunnel socket directory: %w", err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("ztunnel socket path %s exists and is not a socket (%v)", path, fi.Mode())
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale ztunnel socket: %w", err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("stat ztunnel socket path: %w", err)
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("listen on ztunnel socket: %w", err)
	}
	return l, nil
}

// AddWorkload sends an Add with netns to the newest connection and waits for
// its ack. If that connection is still sending its snapshot, the Add is queued
// behind it. Errors: ErrNoZtunnel, *NackError, or one wrapping ErrConnBroken
// (which includes an ack timeout), or ctx's error.
func (s *Server) AddWorkload(ctx context.Context, w Workload, netns *os.File) error {
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
func (s *Server) DelWorkload(ctx context.Context, uid string) error {
	conns := s.all()
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() { errs[i] = c.do(ctx, delReq(uid)) })
	}
	wg.Wait()
	var keep []error
	for _, err := range errs {
		if err != nil && !errors.Is(err, ErrConnBroken) {
			keep = append(keep, err)
		}
	}
	return errors.Join(keep...)
}

// SubscribeSnapshotAcked returns a channel that receives a signal every time
// a ztunnel acks its SnapshotSent (signals coalesce if not drained), and a
// function that unsubscribes.
func (s *Server) SubscribeSnapshotAcked() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	id := s.subID
	s.subID++
	s.subs[id] = ch
	s.mu.Unlock()
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			s.mu.Lock()
			delete(s.subs, id)
			s.mu.Unlock()
		})
	}
}

// Status reports the connections and whether the newest acked its snapshot.
func (s *Server) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Status{Connections: len(s.conns)}
	if n := len(s.conns); n > 0 {
		st.SnapshotAcked = s.conns[n-1].snapshotAcked.Load()
	}
	return st
}

func (s *Server) newest() *zconn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.conns) == 0 {
		return nil
	}
	return s.conns[len(s.conns)-1]
}

func (s *Server) all() []*zconn {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*zconn(nil), s.conns...)
}

func (s *Server) register(c *zconn) {
	s.mu.Lock()
	s.nextID++
	c.id = s.nextID
	s.conns = append(s.conns, c)
	n := len(s.conns)
	s.mu.Unlock()
	s.metrics.connections.Set(float64(n))
}

func (s *Server) unregister(c *zconn) {
	s.mu.Lock()
	for i, x := range s.conns {
		if x == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			break
		}
	}
	n := len(s.conns)
	s.mu.Unlock()
	s.metrics.connections.Set(float64(n))
}

func (s *Server) notifySnapshotAcked() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ch := range s.subs {
		select {
		case ch <- struct{}{}:
		default: // a signal is already pending
		}
	}
}
