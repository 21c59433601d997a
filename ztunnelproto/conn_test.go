package ztunnelproto

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/containernetworking/plugins/pkg/testutils"
	"golang.org/x/sys/unix"
)

// Generous: the machine is shared with other builds.
const testTimeout = 10 * time.Second

// pair returns both ends of a real SOCK_SEQPACKET socketpair.
func pair(t *testing.T) (*Conn, *Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "seqpacket")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = NewConn(c.(*net.UnixConn))
		t.Cleanup(func() { conns[i].Close() })
	}
	return conns[0], conns[1]
}

// rawSend writes a packet with arbitrary descriptors, bypassing Conn's checks.
func rawSend(t *testing.T, c *Conn, b []byte, fds ...int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.uc.WriteMsgUnix(b, oob, nil); err != nil {
		t.Fatalf("raw send: %v", err)
	}
}

func deadline() time.Time { return time.Now().Add(testTimeout) }

func TestBytesOnTheSocket(t *testing.T) {
	a, b := pair(t)
	if err := a.Send(HelloV1(), nil, deadline()); err != nil {
		t.Fatal(err)
	}
	p, err := b.ReadPacket(deadline())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.Data, []byte{0x08, 0x01}) {
		t.Fatalf("hello on the wire: % x", p.Data)
	}
	// SendAndAwaitAck against a peer answering with a nack.
	done := make(chan error, 1)
	go func() {
		req, files, err := b.ReadRequest(deadline())
		if err == nil && (RequestOp(req) != OpDel || RequestUID(req) != "x" || len(files) != 0) {
			err = errors.New("unexpected request " + req.String())
		}
		if err == nil {
			err = b.Send(AckResponse("e"), nil, deadline())
		}
		done <- err
	}()
	ack, err := a.SendAndAwaitAck(DelRequest("x"), nil, testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	if ack.GetError() != "e" {
		t.Fatalf("ack error %q, want e", ack.GetError())
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestRefusesZeroLengthSend(t *testing.T) {
	a, b := pair(t)
	if err := a.WritePacket(nil, nil, deadline()); !errors.Is(err, ErrZeroLength) {
		t.Fatalf("WritePacket(nil): %v, want ErrZeroLength", err)
	}
	// A hello without version encodes to zero bytes: must be refused too.
	if err := a.Send(&ZdsHello{}, nil, deadline()); !errors.Is(err, ErrZeroLength) {
		t.Fatalf("Send(empty hello): %v, want ErrZeroLength", err)
	}
	// Nothing reached the peer.
	if _, err := b.ReadPacket(time.Now().Add(100 * time.Millisecond)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("peer read: %v, want deadline exceeded", err)
	}
}

func TestZeroLengthPacketReadsAsEOF(t *testing.T) {
	a, b := pair(t)
	if _, err := a.uc.Write(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ReadPacket(deadline()); !errors.Is(err, io.EOF) {
		t.Fatalf("got %v, want io.EOF", err)
	}
	a.Close()
	if _, err := b.ReadAck(deadline()); !errors.Is(err, io.EOF) {
		t.Fatalf("after close: got %v, want io.EOF", err)
	}
}

func TestTruncatedPacket(t *testing.T) {
	a, b := pair(t)
	rawSend(t, a, make([]byte, MaxPacketSize+1000))
	if _, err := b.ReadPacket(deadline()); !errors.Is(err, ErrTruncated) || !strings.Contains(err.Error(), "MSG_TRUNC") {
		t.Fatalf("got %v, want ErrTruncated (MSG_TRUNC)", err)
	}
	// The connection stays usable: the next packet reads fine.
	if err := a.Send(AckResponse(""), nil, deadline()); err != nil {
		t.Fatal(err)
	}
	if ack, err := b.ReadAck(deadline()); err != nil || ack.GetError() != "" {
		t.Fatalf("next ack: %v %v", ack, err)
	}
}

func TestTruncatedControlDataClosesFDs(t *testing.T) {
	a, b := pair(t)
	before := testutil.CountFDs(t)
	var fds []int
	for range maxFDs * 2 {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		fds = append(fds, int(f.Fd()))
	}
	rawSend(t, a, []byte{0x0a, 0x00}, fds...)
	if _, err := b.ReadPacket(deadline()); !errors.Is(err, ErrTruncated) || !strings.Contains(err.Error(), "MSG_CTRUNC") {
		t.Fatalf("got %v, want ErrTruncated (MSG_CTRUNC)", err)
	}
	// Only our own maxFDs*2 opens remain: the received copies are closed.
	if got := testutil.CountFDs(t); got != before+len(fds) {
		t.Fatalf("fds: %d before, %d after, want %d (received fds leaked)", before, got, before+len(fds))
	}
}

func TestUnexpectedFDIsClosed(t *testing.T) {
	a, b := pair(t)
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	before := testutil.CountFDs(t)
	rawSend(t, a, []byte{0x0a, 0x00}, int(f.Fd()))
	if _, err := b.ReadAck(deadline()); !errors.Is(err, ErrUnexpectedFD) {
		t.Fatalf("ack with fd: %v, want ErrUnexpectedFD", err)
	}
	if got := testutil.CountFDs(t); got != before {
		t.Fatalf("fds: %d before, %d after: received fd leaked", before, got)
	}
	// Same for a request that must not carry one.
	rawSend(t, a, []byte{0x12, 0x03, 0x12, 0x01, 0x78}, int(f.Fd()))
	req, files, err := b.ReadRequest(deadline())
	if !errors.Is(err, ErrUnexpectedFD) || RequestOp(req) != OpDel || files != nil {
		t.Fatalf("del with fd: %v %v %v, want ErrUnexpectedFD", req, files, err)
	}
	if got := testutil.CountFDs(t); got != before {
		t.Fatalf("fds: %d before, %d after: received fd leaked", before, got)
	}
}

func TestLongErrorString(t *testing.T) {
	a, b := pair(t)
	msg := strings.Repeat("policy says no; ", 400) // ~6 KiB
	if err := a.Send(AckResponse(msg), nil, deadline()); err != nil {
		t.Fatal(err)
	}
	ack, err := b.ReadAck(deadline())
	if err != nil {
		t.Fatal(err)
	}
	if ack.GetError() != msg {
		t.Fatalf("error string: got %d bytes, want %d", len(ack.GetError()), len(msg))
	}
}

func TestReadDeadline(t *testing.T) {
	_, b := pair(t)
	start := time.Now()
	_, err := b.ReadAck(time.Now().Add(50 * time.Millisecond))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("got %v, want deadline exceeded", err)
	}
	if time.Since(start) > testTimeout {
		t.Fatalf("read took %v", time.Since(start))
	}
}

// An Add carries the netns fd in the same sendmsg; the receiver gets a
// descriptor of the very same namespace.
func TestAddCarriesNetnsFD(t *testing.T) {
	testutil.RequireRoot(t)
	netns, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	defer testutils.UnmountNS(netns)
	defer netns.Close()
	f, err := os.Open(netns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	a, b := pair(t)
	before := testutil.CountFDs(t)
	req := AddRequest("uid-1", &WorkloadInfo{Name: "p", Namespace: "ns", ServiceAccount: "sa"})
	if err := a.Send(req, f, deadline()); err != nil {
		t.Fatal(err)
	}
	got, files, err := b.ReadRequest(deadline())
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 1 {
		t.Fatalf("got %d fds, want 1", len(files))
	}
	if RequestUID(got) != "uid-1" || got.GetAdd().GetWorkloadInfo().GetNamespace() != "ns" {
		t.Fatalf("request: %v", got)
	}
	if want, have := inode(t, f), inode(t, files[0]); want != have {
		t.Fatalf("received netns inode %d, want %d", have, want)
	}
	files[0].Close()
	if n := testutil.CountFDs(t); n != before {
		t.Fatalf("fds: %d before, %d after", before, n)
	}
}

func inode(t *testing.T, f *os.File) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestSendClosedFile(t *testing.T) {
	a, b := pair(t)
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := a.Send(DelRequest("x"), f, deadline()); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("got %v, want os.ErrClosed", err)
	}
	if _, err := b.ReadPacket(time.Now().Add(100 * time.Millisecond)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("peer read: %v, want nothing sent", err)
	}
}
