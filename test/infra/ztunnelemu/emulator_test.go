package ztunnelemu

import (
	"errors"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/testutil"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

var info = &zp.WorkloadInfo{Name: "pod", Namespace: "ns", ServiceAccount: "sa"}

func TestSnapshotReconnectAndStreaming(t *testing.T) {
	a := newFakeAgent(t)
	n1, n2 := newNetns(t), newNetns(t)
	e, _ := runEmu(t, Config{SocketPath: a.path, ReconnectMin: 10 * time.Millisecond})

	c := a.accept()
	if got := ack(t, c, zp.AddRequest("a", info), n1.File); got != "" {
		t.Fatalf("add a: %q", got)
	}
	if got := ack(t, c, zp.KeepRequest("ghost"), nil); got != "" {
		t.Fatalf("keep unknown: %q", got)
	}
	if got := ack(t, c, zp.SnapshotSentRequest(), nil); got != "" {
		t.Fatalf("snapshot sent: %q", got)
	}
	for _, step := range []struct {
		req *zp.WorkloadRequest
		f   *os.File
	}{
		{zp.AddRequest("b", &zp.WorkloadInfo{Name: "b", Namespace: "ns"}), n2.File},
		{zp.AddRequest("b", &zp.WorkloadInfo{Name: "b", Namespace: "ns"}), n2.File}, // duplicate, same netns: OK
		{zp.DelRequest("never-added"), nil},                                         // unknown: OK
	} {
		if got := ack(t, c, step.req, step.f); got != "" {
			t.Fatalf("%v: ack error %q", step.req, got)
		}
	}
	st := e.State()
	wa, okA := st.Workload("a")
	wb, okB := st.Workload("b")
	if !okA || !okB || wa.NetnsInode != n1.Inode || wb.NetnsInode != n2.Inode || wa.Name != "pod" || wa.ServiceAccount != "sa" {
		t.Fatalf("workloads after first connection: %+v", st.Workloads)
	}
	want := []SnapshotItem{{zp.OpAdd, "a"}, {zp.OpKeep, "ghost"}}
	if cr, _ := st.Conn(1); !slices.Equal(cr.Snapshot, want) || !cr.SnapshotSent {
		t.Fatalf("conn 1 record: %+v, want snapshot %v", cr, want)
	}

	// The agent restarts: the emulator reconnects and the new snapshot
	// (Keep b only) drops a.
	c.Close()
	c2 := a.accept()
	ack(t, c2, zp.KeepRequest("b"), nil)
	ack(t, c2, zp.SnapshotSentRequest(), nil)
	st = Await(t, e, "a dropped", func(s State) bool { _, ok := s.Workload("a"); return !ok })
	if _, ok := st.Workload("b"); !ok || len(st.Workloads) != 1 {
		t.Fatalf("after second snapshot: %+v", st.Workloads)
	}
	if st.CurrentConn != 2 || len(st.ProtocolErrors) != 0 {
		t.Fatalf("state: conn %d, protocol errors %v", st.CurrentConn, st.ProtocolErrors)
	}
	ack(t, c2, zp.DelRequest("b"), nil)
	if st := e.State(); len(st.Workloads) != 0 {
		t.Fatalf("after del: %+v", st.Workloads)
	}
}

func TestNack(t *testing.T) {
	a := newFakeAgent(t)
	n := newNetns(t)
	long := strings.Repeat("x", 3000)
	e, _ := runEmu(t, Config{SocketPath: a.path, Nacks: map[string]string{"ns/pod": long}})
	c := a.accept()
	ack(t, c, zp.SnapshotSentRequest(), nil)
	if got := ack(t, c, zp.AddRequest("u1", info), n.File); got != long {
		t.Fatalf("nack by namespace/name: got %d bytes", len(got))
	}
	e.SetNack("u2", "no u2")
	if got := ack(t, c, zp.AddRequest("u2", &zp.WorkloadInfo{Name: "other"}), n.File); got != "no u2" {
		t.Fatalf("nack by uid: %q", got)
	}
	e.ClearNack("ns/pod")
	if got := ack(t, c, zp.AddRequest("u1", info), n.File); got != "" {
		t.Fatalf("after ClearNack: %q", got)
	}
	if st := e.State(); len(st.Workloads) != 1 || st.Workloads[0].UID != "u1" {
		t.Fatalf("workloads: %+v", st.Workloads)
	}
}

// Every violation real ztunnel exits on: reported, connection closed, Run
// returns ErrProtocolExit when told to exit, and no descriptor leaks.
func TestProtocolErrors(t *testing.T) {
	n := newNetns(t)
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	var lastConn *net.UnixConn // raw socket of the current subtest, for two fds
	tests := []struct {
		name  string
		setup func(t *testing.T, c *zp.Conn) // before the violation
		send  func(t *testing.T, c *zp.Conn) error
		want  string
	}{
		{"add without workload info", nil, func(t *testing.T, c *zp.Conn) error {
			return c.Send(zp.AddRequest("u", nil), n.File, time.Now().Add(testTimeout))
		}, "without workload_info"},
		{"add without fd", nil, func(t *testing.T, c *zp.Conn) error {
			return c.Send(zp.AddRequest("u", info), nil, time.Now().Add(testTimeout))
		}, "0 file descriptors"},
		{"add with two fds", nil, func(t *testing.T, c *zp.Conn) error {
			b, _ := zp.Marshal(zp.AddRequest("u", info))
			_, _, err := lastConn.WriteMsgUnix(b, unix.UnixRights(int(n.File.Fd()), int(devnull.Fd())), nil)
			return err
		}, "2 file descriptors"},
		{"keep after snapshot", func(t *testing.T, c *zp.Conn) { ack(t, c, zp.SnapshotSentRequest(), nil) }, func(t *testing.T, c *zp.Conn) error {
			return c.Send(zp.KeepRequest("u"), nil, time.Now().Add(testTimeout))
		}, "after SnapshotSent"},
		{"second snapshot sent", func(t *testing.T, c *zp.Conn) { ack(t, c, zp.SnapshotSentRequest(), nil) }, func(t *testing.T, c *zp.Conn) error {
			return c.Send(zp.SnapshotSentRequest(), nil, time.Now().Add(testTimeout))
		}, "second SnapshotSent"},
		{"garbage", nil, func(t *testing.T, c *zp.Conn) error {
			return c.WritePacket([]byte{0xff, 0xff, 0xff}, nil, time.Now().Add(testTimeout))
		}, "bad packet"},
		{"fd on del", nil, func(t *testing.T, c *zp.Conn) error {
			return c.Send(zp.DelRequest("u"), devnull, time.Now().Add(testTimeout))
		}, "unexpected file descriptor"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := testutil.CountFDs(t)
			a := newFakeAgent(t)
			e, done := runEmu(t, Config{SocketPath: a.path, ExitOnProtocolError: true})
			c := a.accept()
			lastConn = a.last
			if tt.setup != nil {
				tt.setup(t, c)
			}
			if err := tt.send(t, c); err != nil {
				t.Fatal(err)
			}
			select {
			case <-done.stopped:
				if err := done.err; !errors.Is(err, ErrProtocolExit) || !strings.Contains(err.Error(), tt.want) {
					t.Fatalf("Run returned %v, want ErrProtocolExit mentioning %q", err, tt.want)
				}
			case <-time.After(testTimeout):
				t.Fatal("emulator did not exit on the protocol error")
			}
			// No ack: the connection just ends, as when ztunnel exits.
			if _, err := c.ReadAck(time.Now().Add(testTimeout)); err == nil {
				t.Fatal("got an ack for a protocol violation")
			}
			st := e.State()
			if len(st.ProtocolErrors) != 1 || !strings.Contains(st.ProtocolErrors[0].Message, tt.want) || len(st.Workloads) != 0 {
				t.Fatalf("state: %+v", st)
			}
			c.Close()
			a.l.Close()
			if got := testutil.CountFDs(t); got != before {
				t.Fatalf("fds: %d before, %d after", before, got)
			}
		})
	}
}

// Without ExitOnProtocolError the emulator drops the connection and
// reconnects, keeping its workloads.
func TestProtocolErrorReconnects(t *testing.T) {
	a := newFakeAgent(t)
	n := newNetns(t)
	e, _ := runEmu(t, Config{SocketPath: a.path, ReconnectMin: 10 * time.Millisecond})
	c := a.accept()
	ack(t, c, zp.AddRequest("u", info), n.File)
	ack(t, c, zp.SnapshotSentRequest(), nil)
	if err := c.Send(zp.SnapshotSentRequest(), nil, time.Now().Add(testTimeout)); err != nil {
		t.Fatal(err)
	}
	c2 := a.accept()
	st := e.State()
	if len(st.ProtocolErrors) != 1 || st.ProtocolErrors[0].ConnID != 1 {
		t.Fatalf("protocol errors: %+v", st.ProtocolErrors)
	}
	if _, ok := st.Workload("u"); !ok {
		t.Fatalf("workload lost on reconnect: %+v", st.Workloads)
	}
	ack(t, c2, zp.KeepRequest("u"), nil)
	ack(t, c2, zp.SnapshotSentRequest(), nil)
	if _, ok := e.State().Workload("u"); !ok {
		t.Fatal("kept workload dropped")
	}
}
