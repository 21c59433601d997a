package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
	zp "github.com/ambientd/ambientd/ztunnelproto"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
)

// The snapshot: Add with fd for pods with a netns, Keep for the others, in
// the registry's order, then SnapshotSent; the emulator enters each netns.
func TestSnapshotOrderKeepAndNetns(t *testing.T) {
	n1, n3 := newNetns(t), newNetns(t)
	src := &source{}
	src.set(
		SnapshotEntry{Workload: wl("a"), Netns: n1.File},
		SnapshotEntry{Workload: wl("b")},
		SnapshotEntry{Workload: wl("c"), Netns: n3.File},
	)
	s, _ := runServer(t, Config{}, src)
	acked, unsub := s.SubscribeSnapshotAcked()
	defer unsub()
	cfg := ztunnelemu.Config{SocketPath: s.cfg.SocketPath, NetnsMode: true}
	e, _ := runEmu(t, cfg)

	st := waitSnapshot(t, e, 1)
	c, _ := st.Conn(1)
	want := []ztunnelemu.SnapshotItem{{Op: zp.OpAdd, UID: "a"}, {Op: zp.OpKeep, UID: "b"}, {Op: zp.OpAdd, UID: "c"}}
	if !slices.Equal(c.Snapshot, want) {
		t.Fatalf("snapshot %v, want %v", c.Snapshot, want)
	}
	reqs := st.RequestsOn(1)
	if len(reqs) != 4 || reqs[3].Op != zp.OpSnapshotSent {
		t.Fatalf("requests on conn 1: %+v", reqs)
	}
	for _, tc := range []struct {
		uid   string
		inode uint64
		n     testNetns
	}{{"a", n1.Inode, n1}, {"c", n3.Inode, n3}} {
		w, ok := st.Workload(tc.uid)
		if !ok || w.NetnsInode != tc.inode || w.Name != "pod-"+tc.uid || w.Namespace != "ns" || w.ServiceAccount != "sa" {
			t.Fatalf("workload %s: %+v (want netns inode %d)", tc.uid, w, tc.inode)
		}
		// The emulator really is inside that netns.
		if line := dialIn(t, tc.n.NetNS, "127.0.0.1:15006"); !strings.Contains(line, "uid="+tc.uid) {
			t.Fatalf("dial 15006 in netns of %s: %q", tc.uid, line)
		}
	}
	select {
	case <-acked:
	case <-time.After(testTimeout):
		t.Fatal("no snapshot-acked signal")
	}
	testutil.WaitFor(t, "status", func() bool { st := s.Status(); return st.Connections == 1 && st.SnapshotAcked })
}

func dialIn(t *testing.T, n *testutil.NetNS, addr string) string {
	t.Helper()
	var line string
	if err := n.NS.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout("tcp", addr, testTimeout)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(testTimeout))
		b := make([]byte, 256)
		k, _ := c.Read(b)
		line = string(b[:k])
		return nil
	}); err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	return line
}

func TestAddsGoToNewestDelsToAll(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{}, &source{})
	old, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, old, 1)
	testutil.WaitFor(t, "first conn acked", func() bool { return s.Status().SnapshotAcked })
	nu, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, nu, 1)
	testutil.WaitFor(t, "second conn acked", func() bool { st := s.Status(); return st.Connections == 2 && st.SnapshotAcked })

	if err := s.AddWorkload(ctxT(t), wl("p"), n.File); err != nil {
		t.Fatal(err)
	}
	if w, ok := nu.State().Workload("p"); !ok || w.NetnsInode != n.Inode {
		t.Fatalf("newest ztunnel lacks the add: %+v", nu.State().Workloads)
	}
	if reqs := old.State().RequestsOn(1); len(reqs) != 1 {
		t.Fatalf("older ztunnel got %+v, want only its SnapshotSent", reqs)
	}
	if err := s.DelWorkload(ctxT(t), "p"); err != nil {
		t.Fatal(err)
	}
	for name, e := range map[string]*ztunnelemu.Emulator{"old": old, "new": nu} {
		reqs := e.State().RequestsOn(1)
		if last := reqs[len(reqs)-1]; last.Op != zp.OpDel || last.UID != "p" {
			t.Fatalf("%s ztunnel: last request %+v, want del p", name, last)
		}
	}
	if len(nu.State().Workloads) != 0 {
		t.Fatalf("workload survived del: %+v", nu.State().Workloads)
	}
}

// A ztunnel that reconnects (restart) and an agent restart both yield a
// fresh snapshot, and each snapshot ack is signalled.
func TestReconnectGetsFreshSnapshot(t *testing.T) {
	n := newNetns(t)
	src := &source{}
	path := socketPath(t)
	s, stopServer := runServer(t, Config{SocketPath: path}, src)
	acked, unsub := s.SubscribeSnapshotAcked()
	defer unsub()
	e, _ := runEmu(t, ztunnelemu.Config{SocketPath: path})
	waitSnapshot(t, e, 1)
	<-acked

	src.set(SnapshotEntry{Workload: wl("p"), Netns: n.File}, SnapshotEntry{Workload: wl("q")})
	if err := s.AddWorkload(ctxT(t), wl("p"), n.File); err != nil {
		t.Fatal(err)
	}
	e.Disconnect()
	st := waitSnapshot(t, e, 2)
	c, _ := st.Conn(2)
	want := []ztunnelemu.SnapshotItem{{Op: zp.OpAdd, UID: "p"}, {Op: zp.OpKeep, UID: "q"}}
	if !slices.Equal(c.Snapshot, want) {
		t.Fatalf("reconnect snapshot %v, want %v", c.Snapshot, want)
	}
	select {
	case <-acked:
	case <-time.After(testTimeout):
		t.Fatal("no signal for the second snapshot")
	}

	// Agent restart: a new server on the same (now stale) socket path.
	stopServer()
	src.set(SnapshotEntry{Workload: wl("p")})
	s2, _ := runServer(t, Config{SocketPath: path}, src)
	st = waitSnapshot(t, e, 3)
	c, _ = st.Conn(3)
	if !slices.Equal(c.Snapshot, []ztunnelemu.SnapshotItem{{Op: zp.OpKeep, UID: "p"}}) {
		t.Fatalf("after agent restart: %v", c.Snapshot)
	}
	if w, ok := st.Workload("p"); !ok || w.NetnsInode != n.Inode {
		t.Fatalf("kept workload lost: %+v", st.Workloads)
	}
	testutil.WaitFor(t, "new server acked", func() bool { return s2.Status().SnapshotAcked })
}

// peer is a hand-driven (often misbehaving) ztunnel.
type peer struct {
	*zp.Conn
	uc *net.UnixConn
}

func rawPeer(t *testing.T, path string) *peer {
	t.Helper()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	c := zp.NewConn(uc)
	t.Cleanup(func() { c.Close() })
	return &peer{Conn: c, uc: uc}
}

// dialPeer connects to the server at path once it listens: the socket file
// appears at bind, a moment before listen, so a connection refused or a
// path not there yet is retried (within testTimeout).
func dialPeer(t *testing.T, path string) *peer {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for {
		uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
		if err == nil {
			c := zp.NewConn(uc)
			t.Cleanup(func() { c.Close() })
			return &peer{Conn: c, uc: uc}
		}
		if !(errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT)) || time.Now().After(deadline) {
			t.Fatalf("connecting to the ztunnel server at %s: %v", path, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func sendHello(t *testing.T, c *peer) {
	t.Helper()
	if err := c.Send(zp.HelloV1(), nil, time.Now().Add(testTimeout)); err != nil {
		t.Fatal(err)
	}
}

// expectRequest reads one request and checks its op.
func expectRequest(t *testing.T, c *peer, op string) *zp.WorkloadRequest {
	t.Helper()
	req, files, err := c.ReadRequest(time.Now().Add(testTimeout))
	if err != nil {
		t.Fatalf("reading %s: %v", op, err)
	}
	for _, f := range files {
		f.Close()
	}
	if zp.RequestOp(req) != op {
		t.Fatalf("got %s, want %s", zp.RequestOp(req), op)
	}
	return req
}

func sendAck(t *testing.T, c *peer, msg string) {
	t.Helper()
	if err := c.Send(zp.AckResponse(msg), nil, time.Now().Add(testTimeout)); err != nil {
		t.Fatal(err)
	}
}

// expectClosed waits until the server hangs up on c.
func expectClosed(t *testing.T, c *peer) {
	t.Helper()
	for {
		_, _, err := c.ReadRequest(time.Now().Add(testTimeout))
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatal("server did not drop the connection")
		}
		return
	}
}

func TestNeverAckedTimesOut(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{AckTimeout: 300 * time.Millisecond}, &source{})
	c := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, c)
	expectRequest(t, c, zp.OpSnapshotSent)
	sendAck(t, c, "")
	testutil.WaitFor(t, "snapshot acked", func() bool { return s.Status().SnapshotAcked })

	start := time.Now()
	err := s.AddWorkload(context.Background(), wl("p"), n.File) // no ctx deadline: the ack timeout bounds it
	if !errors.Is(err, ErrConnBroken) || !strings.Contains(err.Error(), "timed out") {
		t.Fatalf("got %v, want ErrConnBroken saying it timed out", err)
	}
	t.Logf("timed out after %v: %v", time.Since(start), err)
	expectRequest(t, c, zp.OpAdd) // it was sent, never acked
	expectClosed(t, c)
	testutil.WaitFor(t, "connection dropped", func() bool { return s.Status().Connections == 0 })
	if err := s.AddWorkload(ctxT(t), wl("p"), n.File); !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("after drop: %v, want ErrNoZtunnel", err)
	}
}

func TestSnapshotNeverAckedTimesOut(t *testing.T) {
	s, _ := runServer(t, Config{AckTimeout: 300 * time.Millisecond}, &source{})
	c := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, c)
	expectRequest(t, c, zp.OpSnapshotSent)
	expectClosed(t, c)
	testutil.WaitFor(t, "connection dropped", func() bool { return s.Status().Connections == 0 })
}

// Misbehaving peers are dropped; a good ztunnel keeps being served.
func TestBadPeersDroppedOthersServed(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{HelloTimeout: 2 * time.Second}, &source{})
	good, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, good, 1)

	mustAdd := func(uid string) {
		t.Helper()
		testutil.WaitFor(t, "only the good ztunnel left", func() bool { st := s.Status(); return st.Connections == 1 && st.SnapshotAcked })
		if err := s.AddWorkload(ctxT(t), wl(uid), n.File); err != nil {
			t.Fatalf("add %s after bad peer: %v", uid, err)
		}
		if _, ok := good.State().Workload(uid); !ok {
			t.Fatalf("good ztunnel lacks %s", uid)
		}
		if err := s.DelWorkload(ctxT(t), uid); err != nil {
			t.Fatal(err)
		}
	}
	mustAdd("warmup")
	fds, gs := testutil.CountFDs(t), runtime.NumGoroutine()
	tests := []struct {
		name string
		run  func(t *testing.T, c *peer)
	}{
		{"garbage hello", func(t *testing.T, c *peer) {
			if err := c.WritePacket([]byte{0xde, 0xad, 0xbe, 0xef}, nil, time.Now().Add(testTimeout)); err != nil {
				t.Fatal(err)
			}
		}},
		{"zero-length hello", func(t *testing.T, c *peer) {
			rawWrite(t, c, nil)
		}},
		{"no hello at all", func(t *testing.T, c *peer) {}},
		{"garbage while idle", func(t *testing.T, c *peer) {
			sendHello(t, c)
			expectRequest(t, c, zp.OpSnapshotSent)
			sendAck(t, c, "")
			if err := c.WritePacket([]byte{0xff, 0x00}, nil, time.Now().Add(testTimeout)); err != nil {
				t.Fatal(err)
			}
		}},
		{"zero-length while idle", func(t *testing.T, c *peer) {
			sendHello(t, c)
			expectRequest(t, c, zp.OpSnapshotSent)
			sendAck(t, c, "")
			rawWrite(t, c, nil)
		}},
		{"garbage ack", func(t *testing.T, c *peer) {
			sendHello(t, c)
			expectRequest(t, c, zp.OpSnapshotSent)
			if err := c.WritePacket([]byte{0xff, 0x00}, nil, time.Now().Add(testTimeout)); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := rawPeer(t, s.cfg.SocketPath)
			tt.run(t, c)
			expectClosed(t, c)
			mustAdd(fmt.Sprint("p", i))
		})
	}
	// Bad input leaks nothing (the peers' own sockets are closed by now).
	testutil.WaitFor(t, "fds and goroutines back to baseline", func() bool {
		return testutil.CountFDs(t) <= fds && runtime.NumGoroutine() <= gs
	})
}

// rawWrite sends a packet bypassing Conn's zero-length guard.
func rawWrite(t *testing.T, c *peer, b []byte) {
	t.Helper()
	// WritePacket refuses empty packets by design; reach the socket.
	if err := c.WritePacket(b, nil, time.Time{}); !errors.Is(err, zp.ErrZeroLength) {
		t.Fatalf("WritePacket(empty): %v", err)
	}
	if _, err := c.uc.Write(b); err != nil {
		t.Fatal(err)
	}
}

func TestNackAndNoZtunnel(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{}, &source{})
	if err := s.AddWorkload(ctxT(t), wl("p"), n.File); !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("no ztunnel: %v", err)
	}
	if err := s.DelWorkload(ctxT(t), "p"); err != nil {
		t.Fatalf("del with no ztunnel: %v", err)
	}
	long := strings.Repeat("denied by policy. ", 100) // > 1 KiB
	e, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath, Nacks: map[string]string{"ns/pod-p": long}})
	waitSnapshot(t, e, 1)
	testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })
	err := s.AddWorkload(ctxT(t), wl("p"), n.File)
	var nack *NackError
	if !errors.As(err, &nack) || nack.Message != long || nack.UID != "p" || nack.Op != zp.OpAdd {
		t.Fatalf("got %v, want NackError with the %d-byte message", err, len(long))
	}
	if errors.Is(err, ErrConnBroken) || errors.Is(err, ErrNoZtunnel) {
		t.Fatal("nack must not look like a broken connection")
	}
	// The connection survives a nack.
	e.ClearNack("ns/pod-p")
	if err := s.AddWorkload(ctxT(t), wl("p"), n.File); err != nil {
		t.Fatal(err)
	}
}

// Adds made while the newest connection is still in its snapshot are sent
// after SnapshotSent, never interleaved.
func TestAddDuringSnapshotWaits(t *testing.T) {
	n := newNetns(t)
	src := &source{}
	src.set(SnapshotEntry{Workload: wl("k")})
	s, _ := runServer(t, Config{}, src)
	c := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, c)
	expectRequest(t, c, zp.OpKeep)
	testutil.WaitFor(t, "conn registered", func() bool { st := s.Status(); return st.Connections == 1 && !st.SnapshotAcked })
	errc := make(chan error, 1)
	go func() { errc <- s.AddWorkload(ctxT(t), wl("p"), n.File) }()
	sendAck(t, c, "")
	expectRequest(t, c, zp.OpSnapshotSent)
	sendAck(t, c, "")
	if req := expectRequest(t, c, zp.OpAdd); zp.RequestUID(req) != "p" {
		t.Fatalf("add for %q", zp.RequestUID(req))
	}
	sendAck(t, c, "")
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// Concurrent callers are serialized on the connection: no pipelining, every
// caller gets its own ack.
func TestConcurrentAdds(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{}, &source{})
	e, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, e, 1)
	testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })
	e.SetNack("odd-7", "no")
	var wg sync.WaitGroup
	errs := make([]error, 40)
	for i := range errs {
		uid := fmt.Sprintf("even-%d", i)
		if i == 7 {
			uid = "odd-7"
		}
		wg.Go(func() { errs[i] = s.AddWorkload(ctxT(t), wl(uid), n.File) })
	}
	wg.Wait()
	for i, err := range errs {
		var nack *NackError
		if i == 7 {
			if !errors.As(err, &nack) || nack.UID != "odd-7" {
				t.Fatalf("caller 7 got %v, want its own nack", err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	if st := e.State(); len(st.Workloads) != 39 || len(st.ProtocolErrors) != 0 {
		t.Fatalf("workloads %d, protocol errors %v", len(st.Workloads), st.ProtocolErrors)
	}
}

// 1,000 add/del cycles leak no descriptor and no goroutine, with the
// emulator only holding the netns and with it listening inside it.
func TestAddDelCyclesLeakNothing(t *testing.T) {
	for _, netnsMode := range []bool{false, true} {
		t.Run(fmt.Sprintf("netns-mode=%v", netnsMode), func(t *testing.T) {
			n := newNetns(t)
			s, _ := runServer(t, Config{}, &source{})
			e, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath, NetnsMode: netnsMode})
			waitSnapshot(t, e, 1)
			testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })
			ctx := ctxT(t)
			cycle := func(i int) {
				uid := fmt.Sprint("p", i)
				if err := s.AddWorkload(ctx, wl(uid), n.File); err != nil {
					t.Fatalf("cycle %d add: %v", i, err)
				}
				if err := s.DelWorkload(ctx, uid); err != nil {
					t.Fatalf("cycle %d del: %v", i, err)
				}
			}
			cycle(-1) // warm up lazily created state
			fds, gs := testutil.CountFDs(t), runtime.NumGoroutine()
			for i := range 1000 {
				cycle(i)
			}
			if st := e.State(); len(st.Workloads) != 0 || len(st.ProtocolErrors) != 0 {
				t.Fatalf("emulator state after cycles: %d workloads, errors %v", len(st.Workloads), st.ProtocolErrors)
			}
			testutil.WaitFor(t, "fds and goroutines back to baseline", func() bool {
				return testutil.CountFDs(t) <= fds && runtime.NumGoroutine() <= gs
			})
			t.Logf("fds %d → %d, goroutines %d → %d", fds, testutil.CountFDs(t), gs, runtime.NumGoroutine())
		})
	}
}

// Run creates the directory, replaces a stale socket, refuses to delete a
// non-socket file, and cleans up on shutdown.
func TestSocketFileHandling(t *testing.T) {
	path := socketPath(t)
	if err := os.MkdirAll(strings.TrimSuffix(path, "/ztunnel.sock"), 0o755); err != nil {
		t.Fatal(err)
	}
	// A stale socket: bound, never unlinked.
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	s, stop := runServer(t, Config{SocketPath: path}, &source{})
	e, _ := runEmu(t, ztunnelemu.Config{SocketPath: path})
	waitSnapshot(t, e, 1)
	testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })
	stop()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind: %v", err)
	}
	ztunnelemu.Await(t, e, "emulator sees the hangup", func(st ztunnelemu.State) bool { return !st.Connected })

	if err := os.WriteFile(path, []byte("not a socket"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = NewServer(allowTestUser(Config{SocketPath: path}), testLogger(t)).Run(ctxT(t), &source{})
	if err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Run over a regular file: %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "not a socket" {
		t.Fatal("regular file was touched")
	}
}

func TestSubscribeUnsubscribe(t *testing.T) {
	s := NewServer(Config{}, nil)
	ch1, unsub1 := s.SubscribeSnapshotAcked()
	ch2, unsub2 := s.SubscribeSnapshotAcked()
	unsub1()
	unsub1() // idempotent
	s.notifySnapshotAcked()
	s.notifySnapshotAcked() // coalesces, never blocks
	select {
	case <-ch1:
		t.Fatal("unsubscribed channel signalled")
	default:
	}
	select {
	case <-ch2:
	default:
		t.Fatal("subscriber not signalled")
	}
	unsub2()
}

// A netns file closed by its owner before the send is the caller's error,
// not the connection's: nothing went on the wire and the connection stays.
func TestClosedNetnsFile(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{}, &source{})
	e, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, e, 1)
	testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })
	f, err := podnetns.Open(n.NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	err = s.AddWorkload(ctxT(t), wl("p"), f)
	if err == nil || errors.Is(err, ErrConnBroken) || !errors.Is(err, os.ErrClosed) {
		t.Fatalf("closed netns: %v", err)
	}
	if err := s.AddWorkload(ctxT(t), wl("p"), nil); err == nil {
		t.Fatal("nil netns accepted")
	}
	if err := s.AddWorkload(ctxT(t), wl("p"), n.File); err != nil {
		t.Fatalf("connection unusable after a closed netns: %v", err)
	}
	if st := e.State(); len(st.RequestsOn(1)) != 2 {
		t.Fatalf("requests: %+v", st.RequestsOn(1))
	}
}

// TestSubscribeStatus: a status subscriber hears of a connect (hello), the
// snapshot ack and the disconnect, each as it happens — the node condition
// is re-evaluated on these.
func TestSubscribeStatus(t *testing.T) {
	src := &source{}
	s, _ := runServer(t, Config{}, src)
	changed, unsub := s.SubscribeStatus()
	defer unsub()
	wait := func(what string, cond func(Status) bool) {
		t.Helper()
		select {
		case <-changed:
		case <-time.After(testTimeout):
			t.Fatalf("no status signal for %s", what)
		}
		testutil.WaitFor(t, what, func() bool { return cond(s.Status()) })
	}
	c := rawPeer(t, s.cfg.SocketPath)
	sendHello(t, c)
	wait("connect", func(st Status) bool { return st.Connections == 1 })
	expectRequest(t, c, "snapshot_sent")
	sendAck(t, c, "")
	wait("snapshot ack", func(st Status) bool { return st.SnapshotAcked })
	c.Close()
	wait("disconnect", func(st Status) bool { return st.Connections == 0 })
}

// A ztunnel that hangs with its socket open (a deadlock, a full queue)
// answers nothing: the idle probe finds it within ProbeInterval +
// AckTimeout, the connection is dropped, the server reports it
// Unresponsive (not merely gone) and counts it; a healthy ztunnel that
// connects after it serves again and clears that.
func TestIdleProbeFindsAHungZtunnel(t *testing.T) {
	cfg := allowTestUser(Config{SocketPath: socketPath(t), ProbeInterval: 300 * time.Millisecond, AckTimeout: 500 * time.Millisecond})
	s, _ := runServer(t, cfg, &source{})
	hung, _ := runEmu(t, ztunnelemu.Config{SocketPath: cfg.SocketPath})
	waitSnapshot(t, hung, 1)
	// Idle and healthy: probes come and are acked; the connection stays.
	ztunnelemu.Await(t, hung, "two idle probes acked", func(st ztunnelemu.State) bool {
		n := 0
		for _, r := range st.RequestsOn(1) {
			if r.Op == "del" && r.UID == probeUID {
				n++
			}
		}
		return n >= 2
	})
	if st := s.Status(); st.Serving != 1 || st.Unresponsive {
		t.Fatalf("a healthy idle ztunnel: status %+v, want it serving", st)
	}
	hung.Hang()
	testutil.Eventually(t, "the hung ztunnel's connection dropped", 5*time.Second, func() bool { return s.Status().Serving == 0 })
	if st := s.Status(); !st.Unresponsive {
		t.Fatalf("after the hung ztunnel was dropped: status %+v, want Unresponsive", st)
	}
	if got := promtestutil.ToFloat64(s.metrics.hung); got != 1 {
		t.Errorf("ambientd_ztunnel_unresponsive_total = %v, want 1", got)
	}
	healthy, _ := runEmu(t, ztunnelemu.Config{SocketPath: cfg.SocketPath})
	waitSnapshot(t, healthy, 1)
	testutil.Eventually(t, "the new ztunnel serves", 5*time.Second, func() bool { return s.Status().Serving == 1 })
	if st := s.Status(); st.Unresponsive {
		t.Fatalf("with a healthy ztunnel serving: status %+v, want not Unresponsive", st)
	}
}
