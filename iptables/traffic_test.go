package iptables

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// Addresses of the two-namespace traffic setup.
var (
	podIP  = netip.MustParseAddr("10.77.0.2")
	peerIP = netip.MustParseAddr("10.77.0.1")
	// spoofIP is a client address that exists nowhere.
	spoofIP = netip.MustParseAddr("10.77.0.50")

	podIP6   = netip.MustParseAddr("fd00:77::2")
	peerIP6  = netip.MustParseAddr("fd00:77::1")
	spoofIP6 = netip.MustParseAddr("fd00:77::50")
)

// plan is one family's addresses and socket networks for the traffic test.
type plan struct {
	fam                     Family
	pod, peer, spoof, probe netip.Addr
	tcp, udp, localhost     string
}

var plans = []plan{
	{IPv4, podIP, peerIP, spoofIP, ProbeSNATv4, "tcp4", "udp4", "127.0.0.1"},
	{IPv6, podIP6, peerIP6, spoofIP6, rules.ProbeSNATv6, "tcp6", "udp6", "::1"},
}

const appPort, peerPort = 8080, 9090

// vethPair joins a and b with a veth pair (eth0 on both sides), gives each
// side its addresses (IPv4 /24, IPv6 /64 without DAD) and a default route per
// family via the other side.
func vethPair(t testing.TB, a, b ns.NetNS, aIPs, bIPs []netip.Addr) {
	t.Helper()
	err := a.Do(func(ns.NetNS) error {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("adding veth: %w", err)
		}
		peer, err := netlink.LinkByName("peer0")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetNsFd(peer, int(b.Fd())); err != nil {
			return fmt.Errorf("moving veth peer: %w", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	setup := func(n ns.NetNS, name string, ips, gws []netip.Addr) {
		err := n.Do(func(ns.NetNS) error {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if name != "eth0" {
				if err := netlink.LinkSetName(l, "eth0"); err != nil {
					return err
				}
			}
			for _, ip := range ips {
				bits, flags := 24, 0
				if ip.Is6() {
					bits, flags = 64, unix.IFA_F_NODAD
				}
				addr := &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(bits, ip.BitLen())}, Flags: flags}
				if err := netlink.AddrAdd(l, addr); err != nil {
					return fmt.Errorf("adding %s: %w", ip, err)
				}
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			for _, gw := range gws {
				if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
					return fmt.Errorf("default route via %s: %w", gw, err)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("configuring %s in %s: %v", name, n.Path(), err)
		}
	}
	setup(a, "eth0", aIPs, bIPs)
	setup(b, "peer0", bIPs, aIPs)
}

// server answers every TCP connection (or UDP datagram) with its name and the
// connection's SO_ORIGINAL_DST ("-" when there is none), then closes it.
type server struct {
	name string
	ln   net.Listener
	pc   net.PacketConn
}

func markControl(mark int) func(string, string, syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark)
		}); err != nil {
			return err
		}
		return serr
	}
}

// listen starts a server inside n. With mark, the listening socket carries
// ztunnel's 0x539 as real ztunnel's do.
func listen(t testing.TB, n ns.NetNS, network, addr, name string, mark bool) {
	t.Helper()
	lc := net.ListenConfig{}
	if mark {
		lc.Control = markControl(ProxyMark)
	}
	s := &server{name: name}
	err := n.Do(func(ns.NetNS) error {
		var err error
		if strings.HasPrefix(network, "udp") {
			s.pc, err = lc.ListenPacket(context.Background(), network, addr)
		} else {
			s.ln, err = lc.Listen(context.Background(), network, addr)
		}
		return err
	})
	if err != nil {
		t.Fatalf("listening on %s %s in %s: %v", network, addr, n.Path(), err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	if s.pc != nil {
		go func() {
			defer wg.Done()
			buf := make([]byte, 512)
			for {
				_, from, err := s.pc.ReadFrom(buf)
				if err != nil {
					return
				}
				_, _ = s.pc.WriteTo([]byte(s.name+"\n"), from)
			}
		}()
		t.Cleanup(func() { s.pc.Close(); wg.Wait() })
		return
	}
	go func() {
		defer wg.Done()
		for {
			c, err := s.ln.Accept()
			if err != nil {
				return
			}
			_, _ = fmt.Fprintf(c, "%s|%s|%s\n", s.name, originalDst(c), c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap())
			c.Close()
		}
	}()
	t.Cleanup(func() { s.ln.Close(); wg.Wait() })
}

// originalDst reads SO_ORIGINAL_DST (IPv4) or IP6T_SO_ORIGINAL_DST (IPv6):
// the destination before REDIRECT.
func originalDst(c net.Conn) string {
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		return "-"
	}
	v6 := c.LocalAddr().(*net.TCPAddr).AddrPort().Addr().Unmap().Is6()
	res := "-"
	_ = raw.Control(func(fd uintptr) {
		if v6 {
			// IPv6MTUInfo starts with a sockaddr_in6 and is large enough.
			const ip6tSoOriginalDst = 80
			info, err := unix.GetsockoptIPv6MTUInfo(int(fd), unix.SOL_IPV6, ip6tSoOriginalDst)
			if err != nil {
				return
			}
			port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&info.Addr.Port))[:])
			res = netip.AddrPortFrom(netip.AddrFrom16(info.Addr.Addr), port).String()
			return
		}
		// IPv6Mreq is the 16-byte buffer that fits a sockaddr_in.
		m, err := unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
		if err != nil {
			return
		}
		port := binary.BigEndian.Uint16(m.Multiaddr[2:4])
		ip := netip.AddrFrom4([4]byte(m.Multiaddr[4:8]))
		res = netip.AddrPortFrom(ip, port).String()
	})
	return res
}

type dialOpts struct {
	mark        int
	src         netip.Addr
	transparent bool // IP_TRANSPARENT: src need not be local, as ztunnel's inbound spoofing
	timeout     time.Duration
}

// ask connects from inside n and returns the answering server's line.
func ask(n ns.NetNS, network string, dst netip.AddrPort, o dialOpts) (string, error) {
	d := net.Dialer{Timeout: 10 * time.Second}
	if o.timeout != 0 {
		d.Timeout = o.timeout
	}
	if o.mark != 0 || o.transparent {
		d.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				if o.mark != 0 {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, o.mark)
				}
				if serr == nil && o.transparent {
					level, opt := unix.SOL_IP, unix.IP_TRANSPARENT
					if o.src.Is6() {
						level, opt = unix.SOL_IPV6, unix.IPV6_TRANSPARENT
					}
					serr = unix.SetsockoptInt(int(fd), level, opt, 1)
				}
			})
			if err != nil {
				return err
			}
			return serr
		}
	}
	if o.src.IsValid() {
		if network == "udp" {
			d.LocalAddr = &net.UDPAddr{IP: o.src.AsSlice()}
		} else {
			d.LocalAddr = &net.TCPAddr{IP: o.src.AsSlice()}
		}
	}
	var c net.Conn
	if err := n.Do(func(ns.NetNS) error {
		var err error
		c, err = d.Dial(network, dst.String())
		return err
	}); err != nil {
		return "", err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return "", err
	}
	if network == "udp" {
		// Retry a few times: a datagram can be lost while the namespace settles.
		buf := make([]byte, 512)
		for i := 0; i < 5; i++ {
			if _, err := c.Write([]byte("q")); err != nil {
				return "", err
			}
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			k, err := c.Read(buf)
			if err == nil {
				return strings.TrimSpace(string(buf[:k])), nil
			}
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				return "", err
			}
		}
		return "", errors.New("no UDP answer")
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func TestTrafficCapture(t *testing.T) {
	testutil.RequireIptables(t)
	for _, mode := range allModes {
		for _, mark := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/listener-mark=%v", mode, mark), func(t *testing.T) {
				testTraffic(t, mode, mark)
			})
		}
	}
}

// testTraffic runs every probe over IPv4 and IPv6 at once in one dual-stack
// pod: before the rules, with them, and after deleting them.
func testTraffic(t *testing.T, mode Mode, listenerMark bool) {
	ctx := testCtx(t)
	cfg := Config{IPv6: true}
	m := newTestManager(t, mode, cfg)
	pod, peer := newNS(t), newNS(t)
	vethPair(t, pod, peer, []netip.Addr{podIP, podIP6}, []netip.Addr{peerIP, peerIP6})
	// The probe source lives on the peer, routed back by the pod's default route.
	for _, p := range plans {
		if out, err := nsRunErr(peer, "ip", "addr", "add", p.probe.String()+"/"+fmt.Sprint(p.probe.BitLen()), "dev", "eth0", "nodad"); err != nil {
			t.Fatal(out, err)
		}
	}
	type probe struct {
		name     string
		from     ns.NetNS
		network  string
		dst      netip.AddrPort
		opts     dialOpts
		captured string // the answer with our rules in place
		plain    string // the answer without them
	}
	var probes []probe
	for _, p := range plans {
		// ztunnel's ports and the app in the pod; a server and a DNS server on
		// the peer. Like ztunnel: proxies on all addresses, its DNS proxy on
		// localhost (the redirected query's reply must come from localhost
		// to be un-NATed).
		listen(t, pod, p.tcp, fmt.Sprintf(":%d", OutboundPort), "ztunnel-outbound", listenerMark)
		listen(t, pod, p.tcp, fmt.Sprintf(":%d", InboundPort), "ztunnel-inbound", listenerMark)
		listen(t, pod, p.udp, net.JoinHostPort(p.localhost, fmt.Sprint(DNSPort)), "ztunnel-dns", listenerMark)
		listen(t, pod, p.tcp, fmt.Sprintf(":%d", appPort), "app", false)
		listen(t, peer, p.tcp, fmt.Sprintf(":%d", peerPort), "peer", false)
		listen(t, peer, p.udp, ":53", "peer-dns", false)

		peerAddr := netip.AddrPortFrom(p.peer, peerPort)
		appAddr := netip.AddrPortFrom(p.pod, appPort)
		dnsAddr := netip.AddrPortFrom(p.peer, 53)
		v := fmt.Sprintf("IPv%d ", p.fam)
		probes = append(probes,
			probe{v + "outbound", pod, "tcp", peerAddr, dialOpts{},
				"ztunnel-outbound|" + peerAddr.String() + "|" + p.pod.String(), "peer|-|" + p.pod.String()},
			probe{v + "inbound", peer, "tcp", appAddr, dialOpts{},
				"ztunnel-inbound|" + appAddr.String() + "|" + p.peer.String(), "app|-|" + p.peer.String()},
			probe{v + "ztunnel-marked outbound", pod, "tcp", peerAddr, dialOpts{mark: ProxyMark},
				"peer|-|" + p.pod.String(), "peer|-|" + p.pod.String()},
			probe{v + "kubelet probe source", peer, "tcp", appAddr, dialOpts{src: p.probe},
				"app|-|" + p.probe.String(), "app|-|" + p.probe.String()},
			probe{v + "dns", pod, "udp", dnsAddr, dialOpts{}, "ztunnel-dns", "peer-dns"},
			// ztunnel's inbound leg: it connects to the app with the client's
			// address as source (IP_TRANSPARENT, mark 0x539). The app's reply
			// to that foreign address only reaches ztunnel through the
			// connmark and the policy route; without them it leaves on eth0
			// and the connect never completes.
			probe{v + "spoofed-source connect to app", pod, "tcp", appAddr,
				dialOpts{mark: ProxyMark, transparent: true, src: p.spoof, timeout: 3 * time.Second},
				"app|-|" + p.spoof.String(), "error"},
		)
	}

	// check runs all probes at once (they are independent; the ones that
	// must fail wait out their dial timeout side by side).
	check := func(stage string, captured bool) {
		t.Helper()
		var wg sync.WaitGroup
		for _, p := range probes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got, err := ask(p.from, p.network, p.dst, p.opts)
				want := p.plain
				if captured {
					want = p.captured
				}
				if want == "error" {
					if err == nil {
						t.Errorf("%s, %s to %s: got %q, want the connection to fail", stage, p.name, p.dst, got)
					}
					return
				}
				// SO_ORIGINAL_DST on a connection conntrack saw but did not
				// NAT gives its own destination; only redirected ones matter.
				if !captured || !strings.HasPrefix(want, "ztunnel-") {
					got = normalizeOrigDst(got)
				}
				if err != nil || got != want {
					t.Errorf("%s, %s to %s: got %q (err %v), want %q", stage, p.name, p.dst, got, err, want)
				}
			}()
		}
		wg.Wait()
	}

	check("before apply", false)
	if err := m.ApplyPod(ctx, pod, PodOptions{DNSCapture: true}); err != nil {
		t.Fatal(err)
	}
	check("rules applied", true)
	if err := m.DeletePod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	check("rules deleted", false)
}

// normalizeOrigDst replaces the SO_ORIGINAL_DST field with "-" when it just
// names the connection's own destination (conntrack tracked it, no NAT).
func normalizeOrigDst(s string) string {
	parts := strings.Split(s, "|")
	if len(parts) == 3 {
		parts[1] = "-"
	}
	return strings.Join(parts, "|")
}

// TestTrafficIPv6Off: with IPv6 off, a dual-stack pod's IPv4 is captured and
// its IPv6 goes direct, on every backend (nftables pins its family-agnostic
// rules to IPv4, so DNS and marks behave as with the iptables backends).
func TestTrafficIPv6Off(t *testing.T) {
	testutil.RequireIptables(t)
	for _, mode := range allModes {
		t.Run(string(mode), func(t *testing.T) {
			ctx := testCtx(t)
			m := newTestManager(t, mode, Config{})
			pod, peer := newNS(t), newNS(t)
			vethPair(t, pod, peer, []netip.Addr{podIP, podIP6}, []netip.Addr{peerIP, peerIP6})
			for _, p := range plans {
				listen(t, pod, p.tcp, fmt.Sprintf(":%d", OutboundPort), "ztunnel-outbound", true)
				listen(t, pod, p.udp, net.JoinHostPort(p.localhost, fmt.Sprint(DNSPort)), "ztunnel-dns", true)
				listen(t, peer, p.tcp, fmt.Sprintf(":%d", peerPort), "peer", false)
				listen(t, peer, p.udp, ":53", "peer-dns", false)
			}
			if err := m.ApplyPod(ctx, pod, PodOptions{DNSCapture: true}); err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				network string
				dst     netip.AddrPort
				want    string
			}{
				{"tcp", netip.AddrPortFrom(peerIP, peerPort), "ztunnel-outbound"},
				{"udp", netip.AddrPortFrom(peerIP, 53), "ztunnel-dns"},
				{"tcp", netip.AddrPortFrom(peerIP6, peerPort), "peer"},
				{"udp", netip.AddrPortFrom(peerIP6, 53), "peer-dns"},
			} {
				got, err := ask(pod, c.network, c.dst, dialOpts{})
				if err != nil || !strings.HasPrefix(got, c.want) {
					t.Errorf("%s to %s: got %q (err %v), want %s", c.network, c.dst, got, err, c.want)
				}
			}
		})
	}
}
