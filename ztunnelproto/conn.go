package ztunnelproto

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

const (
	// MaxPacketSize is the read buffer. Ack error strings can exceed 1 KiB, so
	// the buffer is far larger than any legitimate ZDS message.
	MaxPacketSize = 64 << 10
	// maxFDs is how many descriptors one read can carry before the kernel
	// reports MSG_CTRUNC. Legitimate packets carry at most one; the headroom
	// lets us receive (and close) a few extra instead of having them dropped.
	maxFDs = 8
)

var (
	// ErrZeroLength is returned for an attempt to send an empty packet: the
	// peer would read it as end-of-file.
	ErrZeroLength = errors.New("refusing to send a zero-length packet (the peer reads it as EOF)")
	// ErrTruncated reports a packet (MSG_TRUNC) or its control data
	// (MSG_CTRUNC) cut short by the kernel.
	ErrTruncated = errors.New("packet truncated")
	// ErrUnexpectedFD reports file descriptors received where none (or fewer)
	// belong; they have been closed.
	ErrUnexpectedFD = errors.New("unexpected file descriptor received (closed)")
)

// Packet is one SEQPACKET message and the descriptors that came with it. The
// receiver owns Files.
type Packet struct {
	Data  []byte
	Files []*os.File
}

// Close closes every file of the packet.
func (p Packet) Close() {
	for _, f := range p.Files {
		f.Close()
	}
}

// Conn is one ZDS connection over AF_UNIX SOCK_SEQPACKET. Reads and writes
// may happen concurrently with each other, but the protocol has no request
// ids, so callers must keep at most one request outstanding.
type Conn struct {
	uc *net.UnixConn

	rmu sync.Mutex // guards buf and oob
	buf []byte
	oob []byte
}

// NewConn wraps an established SOCK_SEQPACKET connection ("unixpacket").
func NewConn(uc *net.UnixConn) *Conn {
	return &Conn{
		uc:  uc,
		buf: make([]byte, MaxPacketSize),
		oob: make([]byte, unix.CmsgSpace(maxFDs*4)),
	}
}

// Dial connects to the ZDS socket at path, as ztunnel does.
func Dial(ctx context.Context, path string) (*Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		return nil, fmt.Errorf("dial zds socket %s: %w", path, err)
	}
	return NewConn(c.(*net.UnixConn)), nil
}

// Close closes the connection; pending reads and writes return errors.
func (c *Conn) Close() error { return c.uc.Close() }

// WritePacket sends b as one packet, with f's descriptor as SCM_RIGHTS in the
// same sendmsg when f is not nil. A zero deadline means none. f stays owned
// by the caller; the kernel duplicates the descriptor for the peer.
func (c *Conn) WritePacket(b []byte, f *os.File, deadline time.Time) error {
	if len(b) == 0 {
		return ErrZeroLength
	}
	if err := c.uc.SetWriteDeadline(deadline); err != nil {
		return fmt.Errorf("set write deadline: %w", err)
	}
	if f == nil {
		if _, _, err := c.uc.WriteMsgUnix(b, nil, nil); err != nil {
			return fmt.Errorf("send packet: %w", err)
		}
		return nil
	}
	// Control pins f's descriptor so a concurrent Close by its owner cannot
	// make us send a recycled fd number.
	// Control only fails when f is closed; say so with os.ErrClosed, which
	// the poller's own error does not wrap.
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("send packet: fd to pass (%s): %w: %v", f.Name(), os.ErrClosed, err)
	}
	var werr error
	if err := rc.Control(func(fd uintptr) {
		_, _, werr = c.uc.WriteMsgUnix(b, unix.UnixRights(int(fd)), nil)
	}); err != nil {
		return fmt.Errorf("send packet: fd to pass (%s): %w: %v", f.Name(), os.ErrClosed, err)
	}
	if werr != nil {
		return fmt.Errorf("send packet with fd %s: %w", f.Name(), werr)
	}
	return nil
}

// ReadPacket reads exactly one packet. A zero deadline means none; a passed
// deadline returns an error wrapping os.ErrDeadlineExceeded. End-of-file and
// a zero-length packet both return io.EOF (SEQPACKET cannot tell them apart,
// and ztunnel treats both as the end of the connection). Truncated packets
// return ErrTruncated with any received descriptors already closed.
func (c *Conn) ReadPacket(deadline time.Time) (Packet, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if err := c.uc.SetReadDeadline(deadline); err != nil {
		return Packet{}, fmt.Errorf("set read deadline: %w", err)
	}
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(c.buf, c.oob)
	var p Packet
	if oobn > 0 {
		files, perr := parseRights(c.oob[:oobn])
		p.Files = files
		if perr != nil && err == nil {
			err = perr
		}
	}
	if err == nil {
		switch {
		case flags&unix.MSG_TRUNC != 0:
			err = fmt.Errorf("%w: packet larger than %d bytes (MSG_TRUNC)", ErrTruncated, len(c.buf))
		case flags&unix.MSG_CTRUNC != 0:
			err = fmt.Errorf("%w: control data (file descriptors) cut short (MSG_CTRUNC)", ErrTruncated)
		case n == 0:
			err = io.EOF
		}
	}
	if err != nil {
		p.Close()
		if errors.Is(err, io.EOF) {
			return Packet{}, io.EOF
		}
		return Packet{}, fmt.Errorf("read packet: %w", err)
	}
	p.Data = append([]byte(nil), c.buf[:n]...)
	return p, nil
}

// parseRights turns SCM_RIGHTS control messages into files; it keeps going
// past a malformed message so every received descriptor gets an owner.
func parseRights(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("%w: parse control data: %v", ErrProtocol, err)
	}
	var files []*os.File
	var errs []error
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			errs = append(errs, fmt.Errorf("%w: control message level %d type %d: %v", ErrProtocol, m.Header.Level, m.Header.Type, err))
			continue
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), fmt.Sprintf("zds-fd-%d", fd)))
		}
	}
	return files, errors.Join(errs...)
}

// Send encodes m and sends it with f (may be nil) as one packet.
func (c *Conn) Send(m proto.Message, f *os.File, deadline time.Time) error {
	b, err := Marshal(m)
	if err != nil {
		return err
	}
	if err := c.WritePacket(b, f, deadline); err != nil {
		return fmt.Errorf("send %T: %w", m, err)
	}
	return nil
}

// readNoFDs reads one packet that must not carry descriptors.
func (c *Conn) readNoFDs(deadline time.Time, what string) ([]byte, error) {
	p, err := c.ReadPacket(deadline)
	if err != nil {
		return nil, err
	}
	if len(p.Files) > 0 {
		p.Close()
		return nil, fmt.Errorf("%w: %d with %s", ErrUnexpectedFD, len(p.Files), what)
	}
	return p.Data, nil
}

// ReadHello reads ztunnel's first packet.
func (c *Conn) ReadHello(deadline time.Time) (*ZdsHello, error) {
	b, err := c.readNoFDs(deadline, "hello")
	if err != nil {
		return nil, fmt.Errorf("read hello: %w", err)
	}
	return DecodeHello(b)
}

// ReadAck reads one WorkloadResponse and returns its ack.
func (c *Conn) ReadAck(deadline time.Time) (*Ack, error) {
	b, err := c.readNoFDs(deadline, "response")
	if err != nil {
		return nil, fmt.Errorf("read ack: %w", err)
	}
	return DecodeResponse(b)
}

// ReadRequest reads one WorkloadRequest (the ztunnel side). Descriptors are
// returned only with an Add, and the caller owns them (checking there is
// exactly one is the caller's job, so it can report what arrived); on any
// other request they are closed and ErrUnexpectedFD returned with the request.
func (c *Conn) ReadRequest(deadline time.Time) (*WorkloadRequest, []*os.File, error) {
	p, err := c.ReadPacket(deadline)
	if err != nil {
		return nil, nil, fmt.Errorf("read request: %w", err)
	}
	req, err := DecodeRequest(p.Data)
	if err != nil {
		p.Close()
		return nil, nil, err
	}
	if RequestOp(req) != OpAdd && len(p.Files) > 0 {
		p.Close()
		return req, nil, fmt.Errorf("%w: %d with %s request", ErrUnexpectedFD, len(p.Files), RequestOp(req))
	}
	return req, p.Files, nil
}

// SendAndAwaitAck sends req (with f, for an Add) and reads the one response
// that answers it, all within timeout. It is for callers that own both
// directions of the connection; a transport failure leaves the connection
// unusable, since a late ack would be matched to the next request. A
// non-empty ack error is returned in the Ack, not as an error.
func (c *Conn) SendAndAwaitAck(req *WorkloadRequest, f *os.File, timeout time.Duration) (*Ack, error) {
	deadline := time.Now().Add(timeout)
	if err := c.Send(req, f, deadline); err != nil {
		return nil, err
	}
	return c.ReadAck(deadline)
}
