package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// readdSource is a source that re-adds, through the server, what it is
// asked to re-add (as the agent's per-pod sync does), and reports the
// pods it has no netns for.
type readdSource struct {
	source
	s    *Server
	lost chan string
}

func (h *readdSource) Readd(uid string, report func(error)) {
	go func() {
		for _, e := range h.Snapshot() {
			if e.Workload.UID != uid {
				continue
			}
			if e.Netns == nil {
				report(errors.New("no netns"))
				h.lost <- uid
				return
			}
			report(h.s.AddWorkload(context.Background(), e.Workload, e.Netns))
		}
	}()
}

// When the newest ztunnel goes away, the pods it held (and only those) are
// handed to the source, which re-adds them to the one that remains, with
// their netns; the results are counted.
func TestReaddToRemainingConnection(t *testing.T) {
	held, other, lost := newNetns(t), newNetns(t), "lost"
	src := &readdSource{lost: make(chan string, 4)}
	s, _ := runServer(t, Config{}, src)
	src.s = s
	old, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, old, 1)
	testutil.WaitFor(t, "first conn acked", func() bool { return s.Status().SnapshotAcked })
	nu, stopNew := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, nu, 1)
	testutil.WaitFor(t, "second conn acked", func() bool { st := s.Status(); return st.Connections == 2 && st.SnapshotAcked })

	for _, w := range []struct {
		uid string
		n   testNetns
	}{{"held", held}, {lost, other}} {
		if err := s.AddWorkload(ctxT(t), wl(w.uid), w.n.File); err != nil {
			t.Fatal(err)
		}
	}
	// The source knows "held" with its netns, "lost" without one, and a
	// pod the closing ztunnel never had.
	src.set(SnapshotEntry{Workload: wl("held"), Netns: held.File}, SnapshotEntry{Workload: wl(lost)},
		SnapshotEntry{Workload: wl("elsewhere"), Netns: other.File})
	stopNew()

	st := ztunnelemu.Await(t, old, "held pod handed over", func(s ztunnelemu.State) bool { _, ok := s.Workload("held"); return ok })
	if w, _ := st.Workload("held"); w.NetnsInode != held.Inode {
		t.Errorf("re-add's Add carried inode %d, want %d", w.NetnsInode, held.Inode)
	}
	if _, ok := st.Workload("elsewhere"); ok {
		t.Errorf("a pod the closed ztunnel never held was handed over")
	}
	select {
	case uid := <-src.lost:
		if uid != lost {
			t.Errorf("lost %q, want %q", uid, lost)
		}
	case <-ctxT(t).Done():
		t.Fatal("pod without netns not reported")
	}
	testutil.WaitFor(t, "re-add results counted", func() bool {
		return counterValue(s.metrics.handovers.WithLabelValues("ok")) == 1 && counterValue(s.metrics.handovers.WithLabelValues("failed")) == 1
	})
}

// The socket is owner-only by default, and with the configured mode. The
// mode is applied right after bind (unixsock.Listen), and runServer returns
// once the file exists: wait for the chmod, failing if it never comes.
func TestSocketMode(t *testing.T) {
	for _, mode := range []os.FileMode{0, 0o660} {
		s, _ := runServer(t, Config{SocketMode: mode}, &source{})
		want := mode
		if want == 0 {
			want = 0o600
		}
		testutil.WaitFor(t, fmt.Sprintf("SocketMode %o: socket mode %o", mode, want), func() bool {
			fi, err := os.Stat(s.cfg.SocketPath)
			if err != nil {
				t.Fatal(err)
			}
			return fi.Mode().Perm() == want
		})
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}
