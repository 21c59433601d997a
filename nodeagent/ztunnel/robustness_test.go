package ztunnel

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/unixsock"
	"github.com/ambientd/ambientd/test/infra/testutil"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// A ztunnel that connects while a Del is being fanned out, and whose snapshot
// still holds the pod, gets the Del too (after its SnapshotSent).
func TestDelReachesConnectionRegisteredDuringFanOut(t *testing.T) {
	src := &source{}
	s, _ := runServer(t, Config{}, src)
	a := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, a)
	expectRequest(t, a, zp.OpSnapshotSent)
	sendAck(t, a, "")
	testutil.WaitFor(t, "first conn acked", func() bool { return s.Status().SnapshotAcked })

	// The agent still lists p: it forgets the pod only once DelWorkload returns.
	src.set(SnapshotEntry{Workload: wl("p")})
	errc := make(chan error, 1)
	go func() { errc <- s.DelWorkload(ctxT(t), "p") }()
	if req := expectRequest(t, a, zp.OpDel); zp.RequestUID(req) != "p" {
		t.Fatalf("del for %q", zp.RequestUID(req))
	}
	// The fan-out is under way (a holds the Del unacked); b connects now and
	// its snapshot still keeps p.
	b := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, b)
	if req := expectRequest(t, b, zp.OpKeep); zp.RequestUID(req) != "p" {
		t.Fatalf("keep for %q", zp.RequestUID(req))
	}
	sendAck(t, a, "") // the fan-out completes while b is mid-snapshot
	sendAck(t, b, "")
	expectRequest(t, b, zp.OpSnapshotSent)
	sendAck(t, b, "")

	type read struct {
		req *zp.WorkloadRequest
		err error
	}
	next := make(chan read, 1)
	go func() {
		req, _, err := b.ReadRequest(time.Now().Add(testTimeout))
		next <- read{req, err}
	}()
	select {
	case err := <-errc:
		t.Fatalf("DelWorkload returned (%v) without sending the Del to the connection that arrived during it", err)
	case r := <-next:
		req := r.req
		if r.err != nil {
			t.Fatalf("conn b: reading after its snapshot: %v", r.err)
		}
		if zp.RequestOp(req) != zp.OpDel || zp.RequestUID(req) != "p" {
			t.Fatalf("conn b got %s %s, want del p", zp.RequestOp(req), zp.RequestUID(req))
		}
	}
	sendAck(t, b, "")
	select {
	case err := <-errc:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(testTimeout):
		t.Fatal("DelWorkload hangs")
	}
}

// recorder is a slog handler that forwards to another and keeps the messages.
type recorder struct {
	slog.Handler
	mu   *sync.Mutex
	msgs *[]string
}

func newRecorder(t testing.TB) (*slog.Logger, func(substr string) bool) {
	r := recorder{Handler: testLogger(t).Handler(), mu: new(sync.Mutex), msgs: new([]string)}
	has := func(substr string) bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, m := range *r.msgs {
			if strings.Contains(m, substr) {
				return true
			}
		}
		return false
	}
	return slog.New(r), has
}

func (r recorder) Handle(ctx context.Context, rec slog.Record) error {
	r.mu.Lock()
	*r.msgs = append(*r.msgs, rec.Message)
	r.mu.Unlock()
	return r.Handler.Handle(ctx, rec)
}

func (r recorder) WithAttrs(as []slog.Attr) slog.Handler {
	return recorder{Handler: r.Handler.WithAttrs(as), mu: r.mu, msgs: r.msgs}
}

func (r recorder) WithGroup(name string) slog.Handler {
	return recorder{Handler: r.Handler.WithGroup(name), mu: r.mu, msgs: r.msgs}
}

// running is a server's Run in the background.
type running struct {
	cancel context.CancelFunc
	done   chan struct{} // closed when Run has returned err
	err    error
}

// startRun runs s in the background until the test ends or r.cancel.
func startRun(t *testing.T, s *Server, src SnapshotSource) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan struct{})}
	go func() {
		r.err = s.Run(ctx, src)
		close(r.done)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(testTimeout):
			t.Error("server did not stop")
		}
	})
	return r
}

// Running out of descriptors makes accept fail; the server retries and serves
// the waiting ztunnel once descriptors are free again.
func TestAcceptRetriesWhenOutOfDescriptors(t *testing.T) {
	log, logged := newRecorder(t)
	path := socketPath(t)
	s := NewServer(allowTestUser(Config{SocketPath: path}), log)
	run := startRun(t, s, &source{})
	testutil.WaitFor(t, "server socket", func() bool { _, err := os.Stat(path); return err == nil })

	// The client's descriptor, made while there are still some to spare.
	cfd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	var filler []int
	release := sync.OnceFunc(func() {
		for _, fd := range filler {
			unix.Close(fd)
		}
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
			t.Errorf("restore RLIMIT_NOFILE: %v", err)
		}
	})
	t.Cleanup(release)
	lim := old
	lim.Cur = min(old.Cur, uint64(fdLimitInUse(t)+64))
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.EMFILE) {
			break
		}
		if err != nil {
			release()
			t.Fatalf("filling the descriptor table: %v", err)
		}
		filler = append(filler, fd)
		if len(filler) > 10000 {
			release()
			t.Fatal("could not exhaust descriptors")
		}
	}
	// connect needs no new descriptor; the server's accept does.
	if err := unix.Connect(cfd, &unix.SockaddrUnix{Name: path}); err != nil {
		release()
		t.Fatal(err)
	}
	var d dto.Metric
	retries := func() float64 {
		if err := s.metrics.retries.Write(&d); err != nil {
			t.Error(err)
		}
		return d.GetCounter().GetValue()
	}
	ok := testutil.Wait(testTimeout, func() bool {
		select {
		case <-run.done:
			return true
		default:
			return retries() >= 1
		}
	})
	select {
	case <-run.done:
		release()
		t.Fatalf("Run gave up on a temporary accept error: %v", run.err)
	default:
	}
	release()
	if !ok || retries() < 1 {
		t.Fatal("no accept retry counted")
	}
	if !logged("accept on ztunnel socket failed; retrying") {
		t.Error("accept retry not logged")
	}

	f := os.NewFile(uintptr(cfd), "client")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	uc := fc.(*net.UnixConn)
	c := &peer{Conn: zp.NewConn(uc), uc: uc}
	t.Cleanup(func() { c.Close() })
	sendHello(t, c)
	expectRequest(t, c, zp.OpSnapshotSent)
	sendAck(t, c, "")
	testutil.WaitFor(t, "acked", func() bool { st := s.Status(); return st.Connections == 1 && st.SnapshotAcked })
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("socket file gone: %v", err)
	}
}

// fdLimitInUse is one more than the highest open descriptor: the lowest
// RLIMIT_NOFILE that keeps every open descriptor usable.
func fdLimitInUse(t *testing.T) int {
	return slices.Max(testutil.OpenFDs(t)) + 1
}

// listenerFD finds the descriptor of the listening socket bound to path.
func listenerFD(t *testing.T, path string) int {
	t.Helper()
	for _, fd := range testutil.OpenFDs(t) {
		sa, err := unix.Getsockname(fd)
		if err != nil {
			continue
		}
		if su, ok := sa.(*unix.SockaddrUnix); !ok || su.Name != path {
			continue
		}
		if v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err == nil && v == 1 {
			return fd
		}
	}
	t.Fatalf("no listening socket for %s", path)
	return -1
}

// A fatal accept error stops the server at once: live connections are closed
// and Run returns the error instead of waiting for them to end on their own.
func TestFatalAcceptErrorClosesConnections(t *testing.T) {
	path := socketPath(t)
	s := NewServer(allowTestUser(Config{SocketPath: path}), testLogger(t))
	run := startRun(t, s, &source{})
	live := dialPeer(t, path)
	sendHello(t, live)
	expectRequest(t, live, zp.OpSnapshotSent)
	sendAck(t, live, "")
	testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })

	// Swap the listener's descriptor for /dev/null behind the server's back,
	// keeping the socket itself open (and polled) through a duplicate. A
	// connection to it then wakes the accept, which fails with ENOTSOCK.
	lfd := listenerFD(t, path)
	keep, err := unix.Dup(lfd)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(keep)
	null, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Dup3(null, lfd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(null)
	rawPeer(t, path) // wakes the accept

	select {
	case <-run.done:
		if !errors.Is(run.err, syscall.ENOTSOCK) {
			t.Fatalf("Run returned %v, want the accept error", run.err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Run did not return after a fatal accept error (waiting for live connections)")
	}
	expectClosed(t, live)
	if st := s.Status(); st.Connections != 0 {
		t.Fatalf("connections left: %d", st.Connections)
	}
}

// A second agent that took over the socket path keeps its socket when the
// first one shuts down.
func TestShutdownLeavesAnotherServersSocket(t *testing.T) {
	path := socketPath(t)
	_, stopOld := runServer(t, Config{SocketPath: path}, &source{})
	oldID := statID(t, path)

	nu := NewServer(allowTestUser(Config{SocketPath: path}), testLogger(t))
	run := startRun(t, nu, &source{})
	testutil.WaitFor(t, "new server's socket", func() bool {
		fi, err := os.Lstat(path)
		return err == nil && unixsock.IDOf(fi) != oldID
	})
	newID := statID(t, path)

	stopOld()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatalf("old server removed the new server's socket: %v", err)
	}
	if unixsock.IDOf(fi) != newID {
		t.Fatal("socket file changed")
	}
	c := rawPeer(t, path)
	sendHello(t, c)
	expectRequest(t, c, zp.OpSnapshotSent)
	sendAck(t, c, "")
	testutil.WaitFor(t, "new server serves", func() bool { st := nu.Status(); return st.Connections == 1 && st.SnapshotAcked })

	run.cancel()
	<-run.done
	if run.err != nil {
		t.Fatal(run.err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("new server left its own socket behind: %v", err)
	}
}

func statID(t *testing.T, path string) unixsock.FileID {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return unixsock.IDOf(fi)
}

// AckTimeout covers the whole round trip: time spent blocked in the send
// counts, so an ack later than AckTimeout after the send began is a timeout.
func TestAckTimeoutIncludesSend(t *testing.T) {
	// An AckTimeout no test waits out: only a deadline counted from the
	// start of the send can have passed when the ack is due.
	const timeout = time.Hour
	var offset atomic.Int64 // the server's clock runs this far ahead
	src := &source{}
	src.set(SnapshotEntry{Workload: wl("k2")})
	path := socketPath(t)
	s := NewServer(allowTestUser(Config{SocketPath: path, AckTimeout: timeout}), testLogger(t))
	s.now = func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
	// k2's send "takes" the whole AckTimeout.
	s.afterSend = func(op, uid string) {
		if uid == "k2" {
			offset.Add(int64(timeout))
		}
	}
	startRun(t, s, src)
	c := dialPeer(t, path)
	sendHello(t, c)
	if req := expectRequest(t, c, zp.OpKeep); zp.RequestUID(req) != "k2" {
		t.Fatalf("keep %q", zp.RequestUID(req))
	}
	var d dto.Metric
	timeouts := func() float64 {
		if err := s.metrics.requests.WithLabelValues(zp.OpKeep, "timeout").Write(&d); err != nil {
			t.Fatal(err)
		}
		return d.GetCounter().GetValue()
	}
	// Well within AckTimeout of the send's end, but not of its start.
	testutil.WaitFor(t, "keep timed out", func() bool { return timeouts() == 1 })
	_ = c.Send(zp.AckResponse(""), nil, time.Now().Add(testTimeout)) // may find the connection closed
	req, _, err := c.ReadRequest(time.Now().Add(testTimeout))
	switch {
	case err == nil:
		t.Fatalf("late ack accepted: server went on with %s", zp.RequestOp(req))
	case errors.Is(err, os.ErrDeadlineExceeded):
		t.Fatal("server neither dropped the connection nor went on")
	case !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET):
		t.Fatalf("read: %v", err)
	}
}

// An ack that is already waiting when the deadline passes is the answer, not
// a timeout.
func TestAckReadyAtDeadlineCounts(t *testing.T) {
	s := NewServer(Config{AckTimeout: time.Second}, testLogger(t))
	for i := range 200 {
		// The ack is already there (the buffered channel stands for a
		// reader blocked on its send) and the deadline has passed, so both
		// select cases are ready; whichever wins, the ack must count.
		c := &zconn{id: 1, s: s, in: make(chan readResult, 1)}
		c.in <- readResult{ack: &zp.Ack{}}
		past := time.Now().Add(-time.Millisecond)
		err, fatal := c.awaitAck(context.Background(), keepReq("p"), past, past)
		if err != nil || fatal {
			t.Fatalf("round %d: ack waiting at the deadline: %v (fatal %v)", i, err, fatal)
		}
	}
}

// The connections gauge is the number of live connections when scraped,
// concurrent registers and unregisters included.
func TestConnectionsGauge(t *testing.T) {
	s := NewServer(Config{}, nil)
	gauge := func() float64 {
		var d dto.Metric
		if err := s.metrics.connections.Write(&d); err != nil {
			t.Fatal(err)
		}
		return d.GetGauge().GetValue()
	}
	both := func(f func(*zconn), a, b *zconn) {
		var wg sync.WaitGroup
		wg.Go(func() { f(a) })
		wg.Go(func() { f(b) })
		wg.Wait()
	}
	a, b := &zconn{}, &zconn{}
	both(s.register, a, b)
	if g := gauge(); g != 2 {
		t.Errorf("gauge %v after two registers, want 2", g)
	}
	s.unregister(a)
	if g := gauge(); g != 1 {
		t.Errorf("gauge %v after one unregister, want 1", g)
	}
	both(s.unregister, b, a) // a again: already gone
	if g := gauge(); g != 0 {
		t.Errorf("gauge %v after the last unregister, want 0", g)
	}
}

// refusalSource records SnapshotRefused calls.
type refusalSource struct {
	source
	mu      sync.Mutex
	refused map[string]error
}

func (r *refusalSource) SnapshotRefused(uid string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refused[uid] = err
}

func (r *refusalSource) got() map[string]error {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]error{}
	for k, v := range r.refused {
		out[k] = v
	}
	return out
}

// Entries ztunnel refuses during the snapshot, or that cannot be sent, are
// reported to the source (SnapshotRefused) before the snapshot-acked
// signal.
func TestSnapshotRefusalsReported(t *testing.T) {
	n := newNetns(t)
	closed, err := podnetns.Open(n.NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	src := &refusalSource{refused: map[string]error{}}
	src.set(
		SnapshotEntry{Workload: wl("nacked"), Netns: n.File},
		SnapshotEntry{Workload: wl("ok"), Netns: n.File},
		SnapshotEntry{Workload: wl("gone"), Netns: closed},
		SnapshotEntry{Workload: wl("kept")},
	)
	s, _ := runServer(t, Config{}, src)
	acked, unsub := s.SubscribeSnapshotAcked()
	defer unsub()
	c := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, c)
	expectRequest(t, c, zp.OpAdd)
	sendAck(t, c, "pod not ready")
	expectRequest(t, c, zp.OpAdd)
	sendAck(t, c, "")
	// "gone" never reaches the wire.
	expectRequest(t, c, zp.OpKeep)
	sendAck(t, c, "")
	expectRequest(t, c, zp.OpSnapshotSent)
	sendAck(t, c, "")
	select {
	case <-acked:
	case <-time.After(testTimeout):
		t.Fatal("no snapshot-acked signal")
	}
	got := src.got()
	var nack *NackError
	if err := got["nacked"]; !errors.As(err, &nack) || nack.UID != "nacked" || nack.Message != "pod not ready" {
		t.Fatalf("refusal of nacked: %v", err)
	}
	if err := got["gone"]; !errors.Is(err, os.ErrClosed) {
		t.Fatalf("refusal of gone: %v", err)
	}
	if len(got) != 2 {
		t.Fatalf("refusals: %v", got)
	}
}
