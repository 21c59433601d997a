package ztunnel

import (
	"os"
	"testing"

	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// refusals is a source that also records what it was told could not be
// handed over.
type refusals struct {
	source
	refused chan string
}

func (r *refusals) SnapshotRefused(uid string, _ error) { r.refused <- uid }

// When the newest ztunnel goes away, the pods it held (and only those) are
// re-added to the one that remains, with their netns; a pod the source has
// no netns for is reported back instead.
func TestHandoverToRemainingConnection(t *testing.T) {
	held, other, lost := newNetns(t), newNetns(t), "lost"
	src := &refusals{refused: make(chan string, 4)}
	s, _ := runServer(t, Config{}, src)
	old, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, old, 1)
	waitUntil(t, "first conn acked", func() bool { return s.Status().SnapshotAcked })
	nu, stopNew := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, nu, 1)
	waitUntil(t, "second conn acked", func() bool { st := s.Status(); return st.Connections == 2 && st.SnapshotAcked })

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

	st := waitState(t, old, "held pod handed over", func(s ztunnelemu.State) bool { _, ok := s.Workload("held"); return ok })
	if w, _ := st.Workload("held"); w.NetnsInode != held.Inode {
		t.Errorf("handover Add carried inode %d, want %d", w.NetnsInode, held.Inode)
	}
	if _, ok := st.Workload("elsewhere"); ok {
		t.Errorf("a pod the closed ztunnel never held was handed over")
	}
	select {
	case uid := <-src.refused:
		if uid != lost {
			t.Errorf("refused %q, want %q", uid, lost)
		}
	case <-ctxT(t).Done():
		t.Fatal("pod without netns not reported")
	}
}

// The socket is created owner-only by default, and with the configured mode.
func TestSocketMode(t *testing.T) {
	for _, mode := range []os.FileMode{0, 0o660} {
		s, _ := runServer(t, Config{SocketMode: mode}, &source{})
		fi, err := os.Stat(s.cfg.SocketPath)
		if err != nil {
			t.Fatal(err)
		}
		want := mode
		if want == 0 {
			want = 0o600
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("SocketMode %o: socket mode %o, want %o", mode, got, want)
		}
	}
}
