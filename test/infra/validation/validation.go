// Package validation is ambientd's own implementation of the check Istio's
// injector runs as the istio-validation init container of a sidecar pod
// whose redirection a node agent programs (CNI mode): proof, before the
// app starts, that the pod's traffic reaches the proxy. Written from the
// contract (docs/sidecar.md), so tests and the real-node suite need no Istio
// image; the oracle check (make istio-oracle-check) proves it agrees with
// Istio's own on the same network namespaces.
//
// The contract: listen on the loopback address (127.0.0.1, or ::1 when the
// pod's first usable address is IPv6) at the proxy's outbound and inbound
// ports; every second dial 127.0.0.6 (::6) port 15002 from the loopback
// address; the capture rules send that connection (the proxy's uid, via lo,
// to a non-loopback address) to the inbound port, where its original
// destination (SO_ORIGINAL_DST) shows port 15002: success, exit 0. Nothing
// within the timeout (5 s): exit 126, the code the repair controller looks
// for. No usable address in the pod: exit 1.
//
// Follows: Istio 1.31 (the revision test/istio-oracle pins), pilot-agent's
// `istio-iptables --run-validation` (istio/istio
// tools/istio-iptables/pkg/validation: validator.go, vld_unix.go).
//
// Does not emulate: anything but the validation run — without
// --run-validation it refuses (istio-iptables' rule programming, the
// istio-init container's job, is not here); of the flags it reads only the
// ports and the probe timeout (the others are accepted and ignored); no
// Windows.
package validation

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Exit codes.
const (
	ExitOK = 0
	// ExitFailed is Istio's ValidationErrorCode: the redirection is not in
	// place (the repair controller matches it).
	ExitFailed = 126
	// ExitUsage: bad arguments or no usable address.
	ExitUsage = 1
)

// Config is the check's parameters (the istio-iptables flags it reads).
type Config struct {
	// OutboundPort (-p) and InboundPort (-z) are listened on.
	OutboundPort, InboundPort uint16
	// ProbePort is the port dialled at the passthrough address.
	ProbePort uint16
	// Timeout bounds the check.
	Timeout time.Duration
	// Interval between dials.
	Interval time.Duration
}

// DefaultConfig is Istio's defaults.
func DefaultConfig() Config {
	return Config{OutboundPort: 15001, InboundPort: 15006, ProbePort: 15002, Timeout: 5 * time.Second, Interval: time.Second}
}

// ParseArgs reads the injected container's args (`istio-iptables -p 15001
// -z 15006 ... --run-validation --skip-rule-apply`): the ports, the probe
// port and timeout; flags it does not need are accepted and ignored, as the
// container passes rule flags too. Without --run-validation it refuses to
// run: this program never programs rules.
func ParseArgs(args []string) (Config, error) {
	c := DefaultConfig()
	if len(args) > 0 && args[0] == "istio-iptables" {
		args = args[1:]
	}
	validate := false
	valued := map[string]bool{"-p": true, "-z": true, "-u": true, "-g": true, "-m": true, "-i": true, "-x": true, "-b": true,
		"-d": true, "-o": true, "-q": true, "-k": true, "-c": true, "-t": true, "-r": true, "--iptables-probe-port": true,
		"--probe-timeout": true, "--log_output_level": true}
	for i := 0; i < len(args); i++ {
		name, val, hasVal := cutFlag(args[i])
		if valued[name] && !hasVal {
			if i+1 >= len(args) {
				return c, fmt.Errorf("flag %s needs a value", name)
			}
			i++
			val = args[i]
		}
		var err error
		switch name {
		case "-p", "--envoy-port":
			c.OutboundPort, err = port(name, val)
		case "-z", "--inbound-capture-port":
			c.InboundPort, err = port(name, val)
		case "--iptables-probe-port":
			c.ProbePort, err = port(name, val)
		case "--probe-timeout":
			c.Timeout, err = time.ParseDuration(val)
			if err == nil && c.Timeout <= 0 {
				err = fmt.Errorf("--probe-timeout %s: must be positive", val)
			}
		case "--run-validation":
			validate = val == "" || val == "true"
		}
		if err != nil {
			return c, err
		}
	}
	if !validate {
		return c, errors.New("only --run-validation is supported: this program checks the redirection, it never programs rules")
	}
	return c, nil
}

func cutFlag(a string) (name, val string, hasVal bool) {
	if len(a) > 2 && a[:2] == "--" {
		for i := 2; i < len(a); i++ {
			if a[i] == '=' {
				return a[:i], a[i+1:], true
			}
		}
	}
	return a, "", false
}

func port(flag, v string) (uint16, error) {
	p, err := strconv.ParseUint(v, 10, 16)
	if err != nil || p == 0 {
		return 0, fmt.Errorf("%s %q: not a port", flag, v)
	}
	return uint16(p), nil
}

// ErrNoAddress: the namespace has no usable (non-loopback, non-link-local)
// address, so its family cannot be told.
var ErrNoAddress = errors.New("no valid local IP address found")

// ErrNotRedirected: no probe arrived redirected within the timeout.
var ErrNotRedirected = errors.New("iptables validation failed; workload is not ready for Istio: the probe to the passthrough address was not redirected to the proxy's inbound port")

// Family returns whether the namespace's first usable address is IPv6.
func Family() (v6 bool, err error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false, err
	}
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() {
			continue
		}
		return ip.Is6(), nil
	}
	return false, ErrNoAddress
}

// Run performs the check in the current network namespace: nil when a
// probe arrived redirected with its original port, ErrNotRedirected after
// the timeout, another error when it could not run.
func Run(ctx context.Context, c Config, v6 bool) error {
	lo, pass := netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.0.0.6")
	if v6 {
		lo, pass = netip.IPv6Loopback(), netip.MustParseAddr("::6")
	}
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	done := make(chan struct{}, 1)
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
		return errors.Join(err, serr)
	}}
	listening := 0
	var lerrs []error
	for _, p := range []uint16{c.OutboundPort, c.InboundPort} {
		l, err := lc.Listen(ctx, "tcp", netip.AddrPortFrom(lo, p).String())
		if err != nil {
			lerrs = append(lerrs, err)
			continue
		}
		listening++
		context.AfterFunc(ctx, func() { l.Close() })
		go accept(l.(*net.TCPListener), v6, c.ProbePort, done)
	}
	if listening == 0 {
		return fmt.Errorf("no listener available: %w", errors.Join(lerrs...))
	}
	dialer := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(lo, 0)), Timeout: c.Interval}
	probe := netip.AddrPortFrom(pass, c.ProbePort).String()
	tick := time.NewTicker(c.Interval)
	defer tick.Stop()
	for {
		if conn, err := dialer.DialContext(ctx, "tcp", probe); err == nil {
			conn.Close()
		}
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			select {
			case <-done:
				return nil
			default:
			}
			return ErrNotRedirected
		case <-tick.C:
		}
	}
}

// accept reads each connection's original destination and reports one
// whose port is the probe port.
func accept(l *net.TCPListener, v6 bool, probe uint16, done chan<- struct{}) {
	for {
		conn, err := l.AcceptTCP()
		if err != nil {
			return
		}
		dst, err := OriginalDst(conn, v6)
		conn.Close()
		if err == nil && dst.Port() == probe {
			select {
			case done <- struct{}{}:
			default:
			}
		}
	}
}

// OriginalDst asks conntrack for a redirected connection's destination
// before the redirect (SO_ORIGINAL_DST, or IP6T_SO_ORIGINAL_DST).
func OriginalDst(c *net.TCPConn, v6 bool) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var out netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		if v6 {
			var sa unix.RawSockaddrInet6
			if serr = getsockopt(fd, unix.SOL_IPV6, soOriginalDst6, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
				out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), netPort(sa.Port))
			}
			return
		}
		var sa unix.RawSockaddrInet4
		if serr = getsockopt(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
			out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), netPort(sa.Port))
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

// soOriginalDst6 is IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h),
// the same number as SO_ORIGINAL_DST at SOL_IPV6.
const soOriginalDst6 = 80

// netPort converts a sockaddr port, stored in network byte order.
func netPort(p uint16) uint16 {
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

// Main is the program: parse args, find the family, run, and return the
// exit code with a message for the container's log (and its termination
// message).
func Main(ctx context.Context, args []string) (int, string) {
	c, err := ParseArgs(args)
	if err != nil {
		return ExitUsage, "istio-validation: " + err.Error()
	}
	v6, err := Family()
	if err != nil {
		return ExitUsage, "istio-validation: " + err.Error()
	}
	if err := Run(ctx, c, v6); err != nil {
		return ExitFailed, "istio-validation: " + err.Error()
	}
	return ExitOK, "istio-validation: validation passed, the pod's traffic is redirected to the proxy"
}
