package ztunnelemu

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// soOriginalDst is SO_ORIGINAL_DST (IPv4, SOL_IP) and IP6T_SO_ORIGINAL_DST
// (IPv6, SOL_IPV6): both 80.
const soOriginalDst = 80

// listener is one TCP listener inside a workload's netns.
type listener struct {
	net.Listener
	port int
	v6   bool
	addr string
}

// listenInNetns enters the netns of nsFile on a locked OS thread (ns.Do) and
// binds ztunnel's ports there, IPv4 always and IPv6 when the netns has it.
// Sockets keep the namespace they were created in, so the listeners serve
// that netns after the thread has switched back.
func listenInNetns(nsFile *os.File, ports []int, mark int) ([]*listener, error) {
	netns, err := ns.GetNS(fmt.Sprintf("/proc/self/fd/%d", nsFile.Fd()))
	if err != nil {
		return nil, fmt.Errorf("open received netns fd: %w", err)
	}
	defer netns.Close()
	var out []*listener
	err = netns.Do(func(ns.NetNS) error {
		for _, port := range ports {
			l, err := listenTCP("tcp4", port, mark)
			if err != nil {
				return err
			}
			out = append(out, l)
			if l6, err := listenTCP("tcp6", port, mark); err == nil {
				out = append(out, l6)
			} else if !noIPv6(err) {
				return err
			}
		}
		return nil
	})
	if err != nil {
		for _, l := range out {
			l.Close()
		}
		return nil, fmt.Errorf("in netns %s: %w", netns.Path(), err)
	}
	return out, nil
}

// noIPv6 tells "this netns has no IPv6" apart from real failures.
func noIPv6(err error) bool {
	return errors.Is(err, unix.EAFNOSUPPORT) || errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.EPROTONOSUPPORT)
}

// listenTCP binds the wildcard address with ztunnel's socket options:
// SO_MARK and SO_REUSEPORT are required, IP_TRANSPARENT is best effort (it
// needs CAP_NET_ADMIN and is irrelevant to REDIRECT-based capture).
func listenTCP(network string, port, mark int) (*listener, error) {
	v6 := network == "tcp6"
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			if err := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
				serr = fmt.Errorf("SO_MARK: %w", err)
				return
			}
			if err := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
				serr = fmt.Errorf("SO_REUSEPORT: %w", err)
				return
			}
			if v6 {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
			} else {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	host := "0.0.0.0"
	if v6 {
		host = "::"
	}
	l, err := lc.Listen(context.Background(), network, net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, fmt.Errorf("listen %s port %d: %w", network, port, err)
	}
	return &listener{Listener: l, port: port, v6: v6, addr: l.Addr().String()}, nil
}

// acceptLoop serves one listener until it is closed. Each connection gets
// one line naming the listener and the original destination, then EOF, so a
// client can tell which listener captured it.
func (e *Emulator) acceptLoop(uid string, l *listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		rec := AcceptRecord{UID: uid, Port: l.port, Remote: c.RemoteAddr().String(), Local: c.LocalAddr().String(), At: time.Now()}
		if dst, err := originalDst(c.(*net.TCPConn), l.v6); err != nil {
			rec.OrigDstError = err.Error()
		} else {
			rec.OrigDst = dst.String()
		}
		e.update(func() { e.accepted = appendCapped(e.accepted, rec, e.cfg.MaxRecords) })
		_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "ztunnel-emulator uid=%s listener=%d orig_dst=%s\n", uid, l.port, rec.OrigDst)
		c.Close()
	}
}

// originalDst asks conntrack for the destination before REDIRECT.
func originalDst(c *net.TCPConn, v6 bool) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var out netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		if v6 {
			var sa unix.RawSockaddrInet6
			if serr = getsockopt(fd, unix.SOL_IPV6, soOriginalDst, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
				out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), port(sa.Port))
			}
			return
		}
		var sa unix.RawSockaddrInet4
		if serr = getsockopt(fd, unix.SOL_IP, soOriginalDst, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
			out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), port(sa.Port))
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: %w", err)
	}
	return out, nil
}

// port converts a sockaddr port, stored in network byte order.
func port(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return binary.BigEndian.Uint16(b[:])
}

func getsockopt(fd uintptr, level, opt int, p unsafe.Pointer, size uintptr) error {
	l := uint32(size)
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), uintptr(opt), uintptr(p), uintptr(unsafe.Pointer(&l)), 0)
	if errno != 0 {
		return errno
	}
	return nil
}
