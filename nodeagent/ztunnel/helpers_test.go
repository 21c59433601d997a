package ztunnel

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// Generous bounds: the machine is shared with other builds.
const testTimeout = 20 * time.Second

func testLogger(t testing.TB) *slog.Logger {
	if _, ok := t.(*testing.B); ok {
		return slog.New(slog.DiscardHandler)
	}
	return testutil.Logger(t, slog.LevelInfo)
}

func ctxT(t testing.TB) context.Context { return testutil.Context(t, testTimeout) }

// socketPath returns a short path (sun_path is 108 bytes) in a dir that does
// not exist yet: Run must create it.
func socketPath(t testing.TB) string {
	dir, err := os.MkdirTemp("", "zds")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "run", "ztunnel.sock")
}

// source is a SnapshotSource the test edits.
type source struct {
	mu      sync.Mutex
	entries []SnapshotEntry
}

func (s *source) Snapshot() []SnapshotEntry {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]SnapshotEntry(nil), s.entries...)
}

// SnapshotRefused and Readd do nothing (refusalSource and
// readdSource record or act on them).
func (s *source) SnapshotRefused(string, error) {}
func (s *source) Readd(string, func(error))     {}

func (s *source) set(e ...SnapshotEntry) {
	s.mu.Lock()
	s.entries = e
	s.mu.Unlock()
}

// runServer starts a server; cleanup stops it and checks Run's result.
func runServer(t testing.TB, cfg Config, src SnapshotSource) (*Server, func()) {
	t.Helper()
	if cfg.SocketPath == "" {
		cfg.SocketPath = socketPath(t)
	}
	s := NewServer(allowTestUser(cfg), testLogger(t))
	stop := testutil.Run(t, func(ctx context.Context) error { return s.Run(ctx, src) })
	// Serving once the socket exists.
	testutil.WaitFor(t, "server socket", func() bool { _, err := os.Stat(cfg.SocketPath); return err == nil })
	return s, stop
}

func runEmu(t testing.TB, cfg ztunnelemu.Config) (*ztunnelemu.Emulator, func()) {
	t.Helper()
	if cfg.ReconnectMin == 0 {
		cfg.ReconnectMin = 10 * time.Millisecond
		cfg.ReconnectMax = 200 * time.Millisecond
	}
	e := ztunnelemu.New(cfg, testLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
			case <-time.After(testTimeout):
				t.Error("emulator did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return e, stop
}

// waitEmu waits until the emulator's current connection has its snapshot.
func waitSnapshot(t testing.TB, e *ztunnelemu.Emulator, connID int) ztunnelemu.State {
	t.Helper()
	return ztunnelemu.Await(t, e, "snapshot on conn", func(s ztunnelemu.State) bool {
		c, ok := s.Conn(connID)
		return ok && c.SnapshotSent && s.CurrentConn == connID
	})
}

// testNetns is a throwaway network namespace and a Handle on it, as the
// registry hands the server.
type testNetns struct {
	*testutil.NetNS
	File *podnetns.Handle
}

// newNetns makes a throwaway network namespace with lo up.
func newNetns(t testing.TB) testNetns {
	t.Helper()
	n := testutil.NewNetNSWith(t, testutil.NetNSOptions{IgnoreRemovalErr: true})
	h, err := podnetns.Open(n.NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return testNetns{NetNS: n, File: h}
}

func wl(uid string) Workload {
	return Workload{UID: uid, Name: "pod-" + uid, Namespace: "ns", ServiceAccount: "sa"}
}

// allowTestUser lets the test process's own uid connect when cfg names no
// uids: the product's default is root only, and a test run by another user
// (make unit) plays ztunnel itself.
func allowTestUser(cfg Config) Config {
	if len(cfg.AllowedUIDs) == 0 {
		cfg.AllowedUIDs = []uint32{0, uint32(os.Getuid())}
	}
	return cfg
}
