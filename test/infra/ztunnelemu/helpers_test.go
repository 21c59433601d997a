package ztunnelemu

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/test/infra/testutil"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// Generous bounds: the machine is shared with other builds.
const testTimeout = 20 * time.Second

// socketPath returns a short path (sun_path is 108 bytes) in a fresh dir.
func socketPath(t testing.TB) string {
	dir, err := os.MkdirTemp("", "zds")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "ztunnel.sock")
}

// fakeAgent is the agent side reduced to the raw protocol, to drive the
// emulator with exactly the packets a test wants.
type fakeAgent struct {
	t    testing.TB
	l    *net.UnixListener
	path string
	last *net.UnixConn // of the latest accept
}

func newFakeAgent(t testing.TB) *fakeAgent {
	path := socketPath(t)
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return &fakeAgent{t: t, l: l, path: path}
}

// accept takes the next connection and checks its hello.
func (a *fakeAgent) accept() *zp.Conn {
	a.t.Helper()
	if err := a.l.SetDeadline(time.Now().Add(testTimeout)); err != nil {
		a.t.Fatal(err)
	}
	uc, err := a.l.AcceptUnix()
	if err != nil {
		a.t.Fatalf("accept: %v", err)
	}
	a.last = uc
	c := zp.NewConn(uc)
	a.t.Cleanup(func() { c.Close() })
	h, err := c.ReadHello(time.Now().Add(testTimeout))
	if err != nil || h.GetVersion() != zp.Version_V1 {
		a.t.Fatalf("hello: %v %v", h, err)
	}
	return c
}

// ack sends req (with fd f) and returns the ack error string.
func ack(t testing.TB, c *zp.Conn, req *zp.WorkloadRequest, f *os.File) string {
	t.Helper()
	a, err := c.SendAndAwaitAck(req, f, testTimeout)
	if err != nil {
		t.Fatalf("%s %s: %v", zp.RequestOp(req), zp.RequestUID(req), err)
	}
	return a.GetError()
}

// emuRun is a running emulator's exit: err is valid once stopped is closed.
type emuRun struct {
	stopped chan struct{}
	err     error
}

// runEmu starts the emulator and stops it (waiting for Run) at cleanup.
func runEmu(t testing.TB, cfg Config) (*Emulator, *emuRun) {
	e := New(cfg, testutil.Logger(t, slog.LevelDebug))
	ctx, cancel := context.WithCancel(context.Background())
	r := &emuRun{stopped: make(chan struct{})}
	go func() {
		r.err = e.Run(ctx)
		close(r.stopped)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.stopped:
		case <-time.After(testTimeout):
			t.Error("emulator did not stop")
		}
	})
	return e, r
}

// testNetns is a throwaway network namespace with lo up.
type testNetns struct{ *testutil.NetNS }

func newNetns(t testing.TB) testNetns {
	t.Helper()
	return testNetns{testutil.NewNetNSWith(t, testutil.NetNSOptions{IgnoreRemovalErr: true})}
}

// dial connects from inside the netns and returns the line the emulator
// writes, or the dial error.
// query sends one UDP datagram to addr from inside the netns and returns
// the one that answers it.
func (n testNetns) query(t testing.TB, addr string) (string, error) {
	t.Helper()
	var line string
	err := n.NS.Do(func(ns.NetNS) error {
		c, err := net.Dial("udp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(testTimeout))
		if _, err := c.Write([]byte("query")); err != nil {
			return err
		}
		buf := make([]byte, 512)
		k, err := c.Read(buf)
		line = string(buf[:k])
		return err
	})
	return line, err
}

func (n testNetns) dial(t testing.TB, addr string) (string, error) {
	t.Helper()
	var line string
	err := n.NS.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout("tcp", addr, testTimeout)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(testTimeout))
		buf := make([]byte, 512)
		total := 0
		for {
			k, err := c.Read(buf[total:])
			total += k
			if err != nil {
				if errors.Is(err, os.ErrDeadlineExceeded) {
					return err
				}
				break
			}
		}
		line = string(buf[:total])
		return nil
	})
	return line, err
}
