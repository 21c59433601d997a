package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/unixsock"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// request is one Add/Keep/Del/SnapshotSent and where its result goes.
type request struct {
	op, uid string
	msg     *zp.WorkloadRequest
	netns   *os.File   // only for Add
	res     chan error // buffered: the owner never blocks on a gone caller
}

func addReq(w Workload, netns *podnetns.Handle) *request {
	return &request{
		op: zp.OpAdd, uid: w.UID, netns: netns.File(), res: make(chan error, 1),
		msg: zp.AddRequest(w.UID, &zp.WorkloadInfo{Name: w.Name, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount}),
	}
}

func keepReq(uid string) *request {
	return &request{op: zp.OpKeep, uid: uid, msg: zp.KeepRequest(uid), res: make(chan error, 1)}
}

func delReq(uid string) *request {
	return &request{op: zp.OpDel, uid: uid, msg: zp.DelRequest(uid), res: make(chan error, 1)}
}

// probeUID is the uid of the idle probe's Del: no pod has it (a pod's uid
// is a UUID), so ztunnel acks it without changing anything.
const probeUID = "ambientd-probe-no-such-pod"

// probeReq is the idle probe: a Del of probeUID (op "probe" in metrics).
func probeReq() *request {
	return &request{op: opProbe, uid: probeUID, msg: zp.DelRequest(probeUID), res: make(chan error, 1)}
}

// opProbe names the idle probe in metrics and logs.
const opProbe = "probe"

// errAckTimeout marks a request ztunnel did not answer in time.
var errAckTimeout = errors.New("timed out")

func snapshotSentReq() *request {
	return &request{op: zp.OpSnapshotSent, msg: zp.SnapshotSentRequest(), res: make(chan error, 1)}
}

// readResult is one packet (or read failure) from the connection's reader.
type readResult struct {
	ack *zp.Ack
	err error
}

// zconn is one ztunnel connection. A single owner goroutine (serve) writes
// requests and consumes acks; a reader goroutine keeps a read pending at all
// times, so a peer that hangs up or talks out of turn is noticed at once, not
// at the next request.
type zconn struct {
	id            uint64
	s             *Server
	src           SnapshotSource
	c             *zp.Conn
	reqs          chan *request   // unbuffered: a request is either taken by the owner or not at all
	in            chan readResult // from the reader
	done          chan struct{}   // closed when the owner has stopped taking requests
	snapshotAcked atomic.Bool
	// held are the pods this ztunnel acked an Add or Keep for and was not
	// told to drop since: what must move elsewhere when it goes away.
	// Only the owner goroutine touches it until done is closed.
	held map[string]struct{}
	// unresponsive: dropped because ztunnel did not answer a request in
	// time (set by the owner before done is closed).
	unresponsive bool
}

// track records what an acked request did to the pods this ztunnel holds.
func (c *zconn) track(r *request) {
	switch r.op {
	case zp.OpAdd, zp.OpKeep:
		c.held[r.uid] = struct{}{}
	case zp.OpDel:
		delete(c.held, r.uid)
	}
}

// do hands r to the connection's owner and waits for the answer.
func (c *zconn) do(ctx context.Context, r *request) error {
	select {
	case c.reqs <- r:
	case <-c.done:
		c.s.metrics.requests.WithLabelValues(r.op, "broken").Inc()
		return fmt.Errorf("%s workload %s: %w: connection %d closed", r.op, r.uid, ErrConnBroken, c.id)
	case <-ctx.Done():
		c.s.metrics.requests.WithLabelValues(r.op, "canceled").Inc()
		return fmt.Errorf("%s workload %s: waiting for connection %d: %w", r.op, r.uid, c.id, ctx.Err())
	}
	// The owner always answers within AckTimeout of sending; ctx may give
	// up sooner.
	select {
	case err := <-r.res:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%s workload %s: waiting for ack on connection %d: %w", r.op, r.uid, c.id, ctx.Err())
	}
}

// serveConn runs one connection from accept to close.
func (s *Server) serveConn(ctx context.Context, uc *net.UnixConn, src SnapshotSource) {
	c := zp.NewConn(uc)
	defer c.Close()
	// Shutdown must not wait out a hello or ack timeout.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	log := s.log.With(peerAttrs(uc)...)
	hello, err := c.ReadHello(time.Now().Add(s.cfg.HelloTimeout))
	if err != nil {
		log.Warn("dropping ztunnel connection: no valid hello", "error", err)
		return
	}

	zc := &zconn{
		s:    s,
		src:  src,
		c:    c,
		reqs: make(chan *request),
		in:   make(chan readResult),
		done: make(chan struct{}),
		held: map[string]struct{}{},
	}
	// Registered before the snapshot is taken: from here on new Adds are
	// queued on this connection, so no pod can fall between snapshot and
	// stream.
	s.register(zc)
	log = log.With("conn", zc.id)
	log.Info("ztunnel connected", "version", hello.GetVersion().String())

	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		zc.read()
	}()
	defer func() {
		s.unregister(zc)
		close(zc.done)
		c.Close() // unblocks the reader
		<-readerDone
		log.Info("ztunnel connection closed", "held", len(zc.held))
		s.readd(ctx, log, zc.src, zc.held)
	}()

	if !zc.sendSnapshot(ctx, log) {
		return
	}
	zc.snapshotAcked.Store(true)
	s.notifySnapshotAcked()

	// The idle probe: ZDS has no heartbeat, so a ztunnel that hangs with
	// its socket open would look like a healthy idle one for ever.
	probe := time.NewTimer(s.cfg.ProbeInterval)
	defer probe.Stop()
	for {
		var r *request
		select {
		case r = <-zc.reqs:
		case <-probe.C:
			r = probeReq()
		case res := <-zc.in:
			if errors.Is(res.err, io.EOF) {
				log.Info("ztunnel hung up")
			} else {
				log.Warn("dropping ztunnel connection: unsolicited packet while idle", "error", res.err, "ack_error", res.ack.GetError())
			}
			return
		case <-ctx.Done():
			return
		}
		err, fatal := zc.roundTrip(ctx, r)
		if err == nil {
			zc.track(r)
		}
		r.res <- err
		probe.Reset(s.cfg.ProbeInterval)
		if fatal {
			if errors.Is(err, errAckTimeout) {
				zc.unresponsive = true
				s.metrics.hung.Inc()
				log.Warn("dropping ztunnel connection: ztunnel did not answer in time (hung); its pods are not served", "op", r.op, "uid", r.uid, "error", err)
			} else {
				log.Warn("dropping ztunnel connection", "op", r.op, "uid", r.uid, "error", err)
			}
			return
		}
	}
}

// sendSnapshot sends Add or Keep for every known pod, then SnapshotSent,
// one at a time. It reports whether the connection is still usable. Entries
// that fail without breaking the connection are reported to the source.
func (c *zconn) sendSnapshot(ctx context.Context, log *slog.Logger) bool {
	entries := c.src.Snapshot()
	adds, keeps := 0, 0
	for _, e := range entries {
		r := keepReq(e.Workload.UID)
		if e.Netns != nil {
			r = addReq(e.Workload, e.Netns)
		}
		err, fatal := c.roundTrip(ctx, r)
		if fatal {
			log.Warn("dropping ztunnel connection during snapshot", "op", r.op, "uid", r.uid, "error", err)
			return false
		}
		if err != nil {
			// Refused (nack) or not sendable (netns closed); the
			// connection is fine. The source hears of it before the
			// snapshot is acked, so it can retry the pod then.
			log.Warn("snapshot entry failed", "op", r.op, "uid", r.uid, "error", err)
			c.src.SnapshotRefused(r.uid, err)
			continue
		}
		c.track(r)
		if r.op == zp.OpAdd {
			adds++
		} else {
			keeps++
		}
	}
	r := snapshotSentReq()
	if err, _ := c.roundTrip(ctx, r); err != nil {
		log.Warn("dropping ztunnel connection: snapshot not acked", "error", err)
		return false
	}
	log.Info("ztunnel acked snapshot", "adds", adds, "keeps", keeps)
	return true
}

// roundTrip sends one request and waits for its ack, all within one
// AckTimeout from the start of the send. fatal means the connection can no
// longer be trusted to pair acks with requests.
func (c *zconn) roundTrip(ctx context.Context, r *request) (err error, fatal bool) {
	m := c.s.metrics
	start := c.s.now()
	deadline := start.Add(c.s.cfg.AckTimeout)
	if err := c.c.Send(r.msg, r.netns, deadline); err != nil {
		if r.netns != nil && errors.Is(err, os.ErrClosed) {
			// The owner closed the netns before we could send it; nothing
			// went on the wire, the connection is fine.
			m.requests.WithLabelValues(r.op, "netns_closed").Inc()
			return fmt.Errorf("%s workload %s: netns file closed before sending: %w", r.op, r.uid, err), false
		}
		m.requests.WithLabelValues(r.op, "broken").Inc()
		return fmt.Errorf("%s workload %s: %w: connection %d: %v", r.op, r.uid, ErrConnBroken, c.id, err), true
	}
	if c.s.afterSend != nil {
		c.s.afterSend(r.op, r.uid)
	}
	return c.awaitAck(ctx, r, start, deadline)
}

// awaitAck waits for the ack of r, sent at start, until deadline. An ack that
// is already waiting when the deadline passes still counts.
func (c *zconn) awaitAck(ctx context.Context, r *request, start, deadline time.Time) (err error, fatal bool) {
	m := c.s.metrics
	timer := time.NewTimer(deadline.Sub(c.s.now()))
	defer timer.Stop()
	select {
	case res := <-c.in:
		return c.ackResult(r, start, res)
	case <-timer.C:
		select {
		case res := <-c.in:
			return c.ackResult(r, start, res)
		default:
		}
		m.requests.WithLabelValues(r.op, "timeout").Inc()
		return fmt.Errorf("%s workload %s: %w: connection %d: no ack within %v (%w)", r.op, r.uid, ErrConnBroken, c.id, c.s.cfg.AckTimeout, errAckTimeout), true
	case <-ctx.Done():
		m.requests.WithLabelValues(r.op, "broken").Inc()
		return fmt.Errorf("%s workload %s: %w: connection %d: agent shutting down", r.op, r.uid, ErrConnBroken, c.id), true
	}
}

// ackResult turns what the reader got in answer to r into roundTrip's result.
func (c *zconn) ackResult(r *request, start time.Time, res readResult) (err error, fatal bool) {
	m := c.s.metrics
	if res.err != nil {
		m.requests.WithLabelValues(r.op, "broken").Inc()
		return fmt.Errorf("%s workload %s: %w: connection %d: %v", r.op, r.uid, ErrConnBroken, c.id, res.err), true
	}
	m.ackSeconds.WithLabelValues(r.op).Observe(c.s.now().Sub(start).Seconds())
	if msg := res.ack.GetError(); msg != "" {
		m.requests.WithLabelValues(r.op, "nack").Inc()
		return &NackError{Op: r.op, UID: r.uid, Message: msg}, false
	}
	m.requests.WithLabelValues(r.op, "ok").Inc()
	return nil, false
}

// read keeps one read pending until the connection fails. The deadline is
// the keepalive: a healthy idle peer lets it expire and we read again; EOF
// (or a zero-length packet) or any packet nobody asked for ends it.
func (c *zconn) read() {
	for {
		ack, err := c.c.ReadAck(time.Now().Add(c.s.cfg.KeepaliveInterval))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		select {
		case c.in <- readResult{ack: ack, err: err}:
		case <-c.done:
			return
		}
		if err != nil {
			return
		}
	}
}

// peerAttrs names the connecting process in logs (SO_PEERCRED: pid, uid,
// gid), so an unexpected peer on the socket is visible.
func peerAttrs(uc *net.UnixConn) []any {
	cred, err := unixsock.PeerCred(uc)
	if err != nil {
		return []any{"peer_cred_error", err.Error()}
	}
	return []any{"peer_pid", cred.Pid, "peer_uid", cred.Uid, "peer_gid", cred.Gid}
}
