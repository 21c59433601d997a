package ztunnelemu

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/validation"
)

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

// DNSPort is ztunnel's DNS proxy port: the in-pod rules redirect a
// captured pod's DNS (UDP and TCP port 53) to it.
const DNSPort = 15053

// dnsInNetns binds ztunnel's DNS port for UDP inside the netns of nsFile
// (IPv4 always, IPv6 when the netns has it), with ztunnel's socket options.
// On the loopback address, as ztunnel does: REDIRECT sends a pod's own
// datagrams there, and an answer must leave from it for conntrack to map
// it back to the address the pod asked (a wildcard socket would answer
// from the pod's address).
func dnsInNetns(nsFile *os.File, mark int) ([]net.PacketConn, error) {
	netns, err := ns.GetNS(fmt.Sprintf("/proc/self/fd/%d", nsFile.Fd()))
	if err != nil {
		return nil, fmt.Errorf("open received netns fd: %w", err)
	}
	defer netns.Close()
	var out []net.PacketConn
	err = netns.Do(func(ns.NetNS) error {
		for _, network := range []string{"udp4", "udp6"} {
			host := "127.0.0.1"
			if network == "udp6" {
				host = "::1"
			}
			lc := ztunnelSocket(network == "udp6", mark)
			pc, err := lc.ListenPacket(context.Background(), network, net.JoinHostPort(host, strconv.Itoa(DNSPort)))
			if err != nil {
				if network == "udp6" && noIPv6(err) {
					continue
				}
				return fmt.Errorf("listen %s port %d: %w", network, DNSPort, err)
			}
			out = append(out, pc)
		}
		return nil
	})
	if err != nil {
		for _, pc := range out {
			pc.Close()
		}
		return nil, fmt.Errorf("in netns %s: %w", netns.Path(), err)
	}
	return out, nil
}

// serveDNS answers every datagram on pc, until it is closed, with one line
// naming the workload and the port (not DNS: the soak's and the tests'
// probes only ask who answered).
func (e *Emulator) serveDNS(uid string, pc net.PacketConn) {
	buf := make([]byte, 512)
	for {
		_, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		_, _ = pc.WriteTo(fmt.Appendf(nil, "ztunnel-emulator uid=%s listener=%d\n", uid, DNSPort), from)
	}
}

// noIPv6 tells "this netns has no IPv6" apart from real failures.
func noIPv6(err error) bool {
	return errors.Is(err, unix.EAFNOSUPPORT) || errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.EPROTONOSUPPORT)
}

// ztunnelSocket is a ListenConfig with ztunnel's socket options: SO_MARK
// and SO_REUSEPORT are required, IP_TRANSPARENT is best effort (it needs
// CAP_NET_ADMIN and is irrelevant to REDIRECT-based capture).
func ztunnelSocket(v6 bool, mark int) net.ListenConfig {
	return net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
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
}

// listenTCP binds the wildcard address with ztunnel's socket options.
func listenTCP(network string, port, mark int) (*listener, error) {
	v6 := network == "tcp6"
	lc := ztunnelSocket(v6, mark)
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
		if dst, err := validation.OriginalDst(c.(*net.TCPConn), l.v6); err != nil {
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
