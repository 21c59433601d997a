package nftables

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The transport of the pod's critical path: one NETLINK_NETFILTER socket
// per operation, plain blocking syscalls on the calling thread, one
// sendmsg per transaction. The library's connection (still used for the
// probe-set elements) costs ~1 ms more per pod transaction in a pod's
// namespace: every send and receive of mdlayher/netlink starts a goroutine
// to watch for cancellation, which on the thread locked into the pod's
// namespace means two OS-thread hand-offs per syscall; it asks an ack of
// every message and an echo of every rule, ~80 receives per apply. Here
// only the last message of a transaction asks for an ack: the kernel
// processes a batch inside the sendmsg and queues every error, and that
// ack, before sendmsg returns (nft itself reads them the same way).
//
// This file is the socket; tx.go encodes and commits transactions,
// list.go decodes the dumps. Messages are encoded with mdlayher/netlink's
// attribute encoder and the library's expression encoding (expr.Marshal):
// the same bytes the library sends (TestEncodingMatchesLibrary), so what
// verify compares and what apply writes stay one encoding.

// recvTimeout bounds every receive: a namespace whose nf_tables does not
// answer fails the operation instead of hanging it.
const recvTimeout = 10 * time.Second

// receiveBuffers holds the sockets' receive buffers for reuse. A dump's
// datagram can be tens of KiB, so each socket reads into 64 KiB; a socket
// lives for one operation, and a burst of ADDs opens a few per pod: without
// reuse those buffers were a fifth of the agent's allocations and several
// MiB of its peak heap. Package-level like encoding/json's and fmt's pools:
// it holds no state, only spare memory.
var receiveBuffers = sync.Pool{New: func() any { b := make([]byte, 64*1024); return &b }}

// conn is one netlink socket of the namespace the calling thread was in
// when it was opened; it stays bound to that namespace whichever thread
// uses it.
type conn struct {
	fd  int
	seq uint32
	// buf is from receiveBuffers and goes back at close; every message
	// receive returns is copied out of it.
	buf *[]byte
	// closing counts the release in the background (see close).
	closing *sync.WaitGroup
}

// dial opens a socket in the calling thread's network namespace.
func dial(closing *sync.WaitGroup) (*conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	tv := unix.NsecToTimeval(recvTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink receive timeout: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink bind: %w", err)
	}
	return &conn{fd: fd, buf: receiveBuffers.Get().(*[]byte), closing: closing}, nil
}

// close releases the socket in the background (synchronously when no
// WaitGroup counts it): the kernel makes the
// release of any nftables socket wait while objects deleted by a committed
// transaction (ours or another pod's) await destruction after an RCU grace
// period — several ms on the pod's critical path for nothing, since the
// transaction is already committed. Bounded: a release returns after the
// grace period.
func (c *conn) close() {
	fd := c.fd
	if c.buf != nil {
		receiveBuffers.Put(c.buf)
		c.buf = nil
	}
	if c.closing == nil {
		_ = unix.Close(fd)
		return
	}
	c.closing.Add(1)
	go func() {
		defer c.closing.Done()
		_ = unix.Close(fd)
	}()
}

func (c *conn) nextSeq() uint32 {
	c.seq++
	return c.seq
}

// header is nlmsghdr plus nfgenmsg.
func header(b []byte, typ uint16, flags uint16, seq uint32, family uint8, resID uint16) []byte {
	b = binary.NativeEndian.AppendUint32(b, 0) // length, set by finish
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = binary.NativeEndian.AppendUint16(b, flags)
	b = binary.NativeEndian.AppendUint32(b, seq)
	b = binary.NativeEndian.AppendUint32(b, 0) // port id: the kernel's
	return append(b, family, unix.NFNETLINK_V0, byte(resID>>8), byte(resID))
}

// finish sets the length of the message that starts at start and pads it.
func finish(b []byte, start int) []byte {
	binary.NativeEndian.PutUint32(b[start:], uint32(len(b)-start))
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func msgType(t int) uint16 { return uint16(unix.NFNL_SUBSYS_NFTABLES<<8 | t) }

// send writes b to the kernel.
func (c *conn) send(b []byte) error {
	for {
		err := unix.Sendto(c.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		if err != unix.EINTR {
			return err
		}
	}
}

// receive reads one datagram and returns its messages. flags are the recv
// flags (MSG_DONTWAIT to drain).
func (c *conn) receive(flags int) ([]mnl.Message, error) {
	if c.buf == nil {
		return nil, errors.New("netlink socket used after close")
	}
	n, _, rflags, _, err := unix.Recvmsg(c.fd, *c.buf, nil, flags)
	for err == unix.EINTR {
		// A signal (a child's SIGCHLD, say) interrupts a receive on a
		// socket with a timeout instead of restarting it.
		n, _, rflags, _, err = unix.Recvmsg(c.fd, *c.buf, nil, flags)
	}
	if err == unix.EAGAIN && flags&unix.MSG_DONTWAIT == 0 {
		return nil, fmt.Errorf("no answer from the kernel within %s: %w", recvTimeout, err)
	}
	if err != nil {
		return nil, err
	}
	if rflags&unix.MSG_TRUNC != 0 {
		return nil, errors.New("netlink message truncated")
	}
	var out []mnl.Message
	for b := (*c.buf)[:n]; len(b) >= unix.NLMSG_HDRLEN; {
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return nil, fmt.Errorf("netlink message of length %d in %d bytes", l, len(b))
		}
		var m mnl.Message
		if err := m.UnmarshalBinary(b[:l]); err != nil {
			return nil, err
		}
		// Copied: the buffer is reused by the next receive.
		m.Data = append([]byte(nil), m.Data...)
		out = append(out, m)
		b = b[min(len(b), (l+3)&^3):]
	}
	return out, nil
}

// errnoOf returns the error an NLMSG_ERROR message carries (nil for an ack).
func errnoOf(m mnl.Message) error {
	if len(m.Data) < 4 {
		return errors.New("short netlink error message")
	}
	if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
		return unix.Errno(-e)
	}
	return nil
}

// dump sends a dump request of type t for family (attrs, if any, filter it)
// and calls fn with the family and attributes of every message until the
// dump is done.
func (c *conn) dump(t int, family uint8, attrs []byte, fn func(family uint8, attrs []byte) error) error {
	seq := c.nextSeq()
	b := header(nil, msgType(t), unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq, family, 0)
	b = finish(append(b, attrs...), 0)
	if err := c.send(b); err != nil {
		return err
	}
	for {
		msgs, err := c.receive(0)
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Sequence != seq {
				continue
			}
			switch m.Header.Type {
			case mnl.Done:
				return nil
			case mnl.Error:
				if err := errnoOf(m); err != nil {
					return err
				}
				return nil
			}
			if len(m.Data) < 4 {
				continue
			}
			if err := fn(m.Data[0], m.Data[4:]); err != nil {
				return err
			}
		}
	}
}
