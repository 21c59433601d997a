package sidecar_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/validation"
)

// helperEnv makes the test binary a helper (TestMain): run as the proxy's
// uid, inside the namespace of the thread that started it.
const helperEnv = "AMBIENTD_SIDECAR_TEST_HELPER"

func TestMain(m *testing.M) {
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(helper(h, os.Args[1:]))
	}
	os.Exit(m.Run())
}

// helper modes: "validate ARGS..." runs our istio-validation and exits
// with its code; "dial ADDR" dials and prints the first line answered.
func helper(mode string, args []string) int {
	switch mode {
	case "validate":
		code, msg := validation.Main(context.Background(), args)
		fmt.Println(msg)
		return code
	case "udpserve":
		return udpServe(args[0], args[1])
	case "dial":
		line, err := dialLine(args[0])
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Println(line)
		return 0
	}
	fmt.Println("unknown helper mode", mode)
	return 2
}

// runAs runs the test binary as uid:gid in n with the helper mode and
// returns its exit code and output.
func runAs(t *testing.T, n ns.NetNS, uid, gid uint32, mode string, args ...string) (int, string) {
	t.Helper()
	bin := helperBinary(t)
	var code int
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = []string{helperEnv + "=" + mode}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
		var err error
		out, err = cmd.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code, err = ee.ExitCode(), nil
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return code, strings.TrimSpace(string(out))
}

var helperBin string

// helperBinary is a copy of the test binary any uid may run.
func helperBinary(t *testing.T) string {
	t.Helper()
	if helperBin != "" {
		return helperBin
	}
	dir, err := os.MkdirTemp("", "sidecar-helper-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	in, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "helper")
	if err := os.WriteFile(p, in, 0o755); err != nil {
		t.Fatal(err)
	}
	helperBin = p
	return p
}

// validationArgs are the injected istio-validation container's args of a
// golden pod.
func validationArgs(t *testing.T, c istiogolden.Case) []string {
	t.Helper()
	for _, ct := range c.Injected.Spec.InitContainers {
		if ct.Name == "istio-validation" {
			return ct.Args
		}
	}
	t.Fatalf("%s: no istio-validation container", c.Name)
	return nil
}

// Addresses of the pod and its peer (the rest of the network).
var (
	podIPs  = []netip.Addr{netip.MustParseAddr("10.244.0.17"), netip.MustParseAddr("fd00:10:244::11")}
	peerIPs = []netip.Addr{netip.MustParseAddr("10.244.0.1"), netip.MustParseAddr("fd00:10:244::1")}
)

const appPort, peerPort, statusPort = 8080, 9090, 15021

// podWithPeer makes a pod namespace and a peer namespace joined by a veth
// pair, both families, default routes via each other.
func podWithPeer(t *testing.T) (pod, peer ns.NetNS) {
	t.Helper()
	pod, peer = testutil.NewNetNS(t).NS, testutil.NewNetNS(t).NS
	err := pod.Do(func(ns.NetNS) error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}); err != nil {
			return err
		}
		p, err := netlink.LinkByName("peer0")
		if err != nil {
			return err
		}
		return netlink.LinkSetNsFd(p, int(peer.Fd()))
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
			for _, ip := range ips {
				bits, flags := 24, 0
				if ip.Is6() {
					bits, flags = 64, unix.IFA_F_NODAD
				}
				if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(bits, ip.BitLen())}, Flags: flags}); err != nil {
					return err
				}
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			for _, gw := range gws {
				if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	setup(pod, "eth0", podIPs, peerIPs)
	setup(peer, "peer0", peerIPs, podIPs)
	return pod, peer
}

// serve runs a TCP listener in n that answers each connection with
// "<name> <local address> <original destination or ->" and closes it.
// transparent makes it an IP_TRANSPARENT listener (TPROXY's target).
func serve(t *testing.T, n ns.NetNS, name, addr string, transparent bool) {
	t.Helper()
	var l net.Listener
	err := n.Do(func(ns.NetNS) error {
		lc := net.ListenConfig{Control: func(network, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
				if transparent && serr == nil {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
					if serr == nil && strings.HasSuffix(network, "6") {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
					}
				}
			})
			return errors.Join(err, serr)
		}}
		network := "tcp4"
		if netip.MustParseAddrPort(addr).Addr().Is6() {
			network = "tcp6"
		}
		var err error
		l, err = lc.Listen(context.Background(), network, addr)
		return err
	})
	if err != nil {
		t.Fatalf("%s listening on %s: %v", name, addr, err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			tc := c.(*net.TCPConn)
			dst := "-"
			la := netip.MustParseAddrPort(tc.LocalAddr().String())
			if d, err := validation.OriginalDst(tc, la.Addr().Is6() && !la.Addr().Is4In6()); err == nil && d != la {
				dst = d.String()
			}
			fmt.Fprintf(c, "%s %s %s\n", name, la, dst)
			c.Close()
		}
	}()
}

// serveUDPAs answers each datagram in n with "<name> <local address>",
// from a helper process running as uid:gid (the proxy's DNS sockets are the
// proxy's: its replies take the conntrack zone the rules give them).
func serveUDPAs(t *testing.T, n ns.NetNS, uid, gid uint32, name, addr string) {
	t.Helper()
	bin := helperBinary(t)
	var cmd *exec.Cmd
	var out io.ReadCloser
	err := n.Do(func(ns.NetNS) error {
		cmd = exec.Command(bin, name, addr)
		cmd.Env = []string{helperEnv + "=udpserve"}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}, Pdeathsig: syscall.SIGKILL}
		var err error
		if out, err = cmd.StdoutPipe(); err != nil {
			return err
		}
		return cmd.Start()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "ready" {
		t.Fatalf("udp server %s: %q %v", addr, line, err)
	}
}

func udpServe(name, addr string) int {
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("ready")
	buf := make([]byte, 512)
	for {
		_, from, err := pc.ReadFrom(buf)
		if err != nil {
			return 1
		}
		_, _ = pc.WriteTo([]byte(name+" "+pc.LocalAddr().String()+"\n"), from)
	}
}

func dialLine(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// dialIn dials addr from n (as root: an app of the pod) and returns the
// answer.
func dialIn(t *testing.T, n ns.NetNS, addr string) string {
	t.Helper()
	var line string
	err := n.Do(func(ns.NetNS) error {
		var err error
		line, err = dialLine(addr)
		return err
	})
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	return line
}

func udpIn(t *testing.T, n ns.NetNS, addr string) string {
	t.Helper()
	var line string
	err := n.Do(func(ns.NetNS) error {
		c, err := net.Dial("udp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write([]byte("q")); err != nil {
			return err
		}
		buf := make([]byte, 512)
		k, err := c.Read(buf)
		line = strings.TrimSpace(string(buf[:k]))
		return err
	})
	if err != nil {
		t.Fatalf("udp %s: %v", addr, err)
	}
	return line
}

func hostPort(a netip.Addr, p int) string { return netip.AddrPortFrom(a, uint16(p)).String() }

// TestSidecarTraffic programs ours for Istio-injected golden pods, on every
// backend, in a pod namespace joined to a peer, and proves with real
// connections what a sidecar pod needs: istio-validation (ours, as the
// injected container runs it: uid 1337, its args) fails with 126 before and
// passes after; the app's outbound TCP lands on the stand-in proxy's 15001
// with the original destination; inbound to the app port lands on 15006
// (REDIRECT) or on the transparent 15006 listener with the original
// destination kept (TPROXY); the proxy's own connections (uid 1337) and the
// excluded status port are not captured; with DNS capture the app's UDP DNS
// lands on 15053; on IPv6 too when the pod is dual-stack with
// ISTIO_DUAL_STACK. After delete, traffic flows uncaptured again.
func TestSidecarTraffic(t *testing.T) {
	testutil.RequireIptables(t, "nft")
	ctx := testCtx(t)
	for _, mode := range allModes {
		m := newManager(t, mode)
		for _, name := range []string{"redirect-default", "dualstack", "dns-capture", "tproxy", "tproxy-dualstack"} {
			t.Run(string(mode)+"/"+name, func(t *testing.T) {
				c, err := istiogolden.LoadCase(name)
				if err != nil {
					t.Fatal(err)
				}
				p, err := sidecar.Parse(c.Injected, c.IPs())
				if err != nil {
					t.Fatal(err)
				}
				o := p.Options
				pod, peer := podWithPeer(t)
				args := validationArgs(t, c)
				if mode == iptables.ModeLegacy {
					// Once per pod kind (5 s each): without rules, the
					// check fails with Istio's code.
					if code, out := runAs(t, pod, 1337, 1337, "validate", args...); code != validation.ExitFailed {
						t.Fatalf("validation without rules: exit %d, want %d: %s", code, validation.ExitFailed, out)
					}
				}
				if err := m.ApplySidecar(ctx, pod, o, nil); err != nil {
					t.Fatal(err)
				}
				if code, out := runAs(t, pod, 1337, 1337, "validate", args...); code != validation.ExitOK {
					t.Fatalf("validation with our rules: exit %d: %s", code, out)
				}

				fams := []int{0}
				if o.IPv6 {
					fams = append(fams, 1)
				}
				for _, fi := range fams {
					podIP, peerIP := podIPs[fi], peerIPs[fi]
					any := "0.0.0.0"
					if fi == 1 {
						any = "::"
					}
					serve(t, pod, "outbound", hostPort(netip.MustParseAddr(any), 15001), false)
					serve(t, pod, "inbound", hostPort(netip.MustParseAddr(any), 15006), o.TProxy())
					serve(t, pod, "app", hostPort(podIP, appPort), false)
					serve(t, pod, "status", hostPort(podIP, statusPort), false)
					serve(t, peer, "peer", hostPort(peerIP, peerPort), false)

					want := fmt.Sprintf("outbound %s %s", hostPort(lo(fi), 15001), hostPort(peerIP, peerPort))
					if got := dialIn(t, pod, hostPort(peerIP, peerPort)); got != want {
						t.Errorf("app outbound: %q, want %q", got, want)
					}
					if code, got := runAs(t, pod, 1337, 1337, "dial", hostPort(peerIP, peerPort)); code != 0 || !strings.HasPrefix(got, "peer ") {
						t.Errorf("proxy's own outbound (uid 1337): %q (exit %d), want the peer", got, code)
					}
					want = fmt.Sprintf("inbound %s %s", hostPort(podIP, 15006), hostPort(podIP, appPort))
					if o.TProxy() {
						// TPROXY delivers to the transparent listener
						// with the original destination as local address.
						want = fmt.Sprintf("inbound %s -", hostPort(podIP, appPort))
					}
					if got := dialIn(t, peer, hostPort(podIP, appPort)); got != want {
						t.Errorf("inbound to the app port: %q, want %q", got, want)
					}
					if got := dialIn(t, peer, hostPort(podIP, statusPort)); !strings.HasPrefix(got, "status ") {
						t.Errorf("inbound to the excluded status port: %q, want the status listener", got)
					}
					if o.DNS {
						serveUDPAs(t, pod, 1337, 1337, "dns", hostPort(lo(fi), 15053))
						if got := udpIn(t, pod, hostPort(peerIP, 53)); got != "dns "+hostPort(lo(fi), 15053) {
							t.Errorf("app DNS over UDP: %q, want the proxy's DNS listener", got)
						}
					}
				}
				if err := m.DeleteSidecar(ctx, pod, &o); err != nil {
					t.Fatal(err)
				}
				if got := dialIn(t, pod, hostPort(peerIPs[0], peerPort)); !strings.HasPrefix(got, "peer ") {
					t.Errorf("after delete, app outbound: %q, want the peer", got)
				}
				if d, err := m.VerifySidecar(ctx, pod, o); err != nil || d.Empty() {
					t.Errorf("after delete, verify: %v %s", err, d)
				}
			})
		}
	}
}

// podWithAddrs is a namespace holding the golden pod's addresses on an
// interface (a veth whose peer stays in it; the validators read the family
// from the addresses).
func podWithAddrs(t *testing.T, c istiogolden.Case) ns.NetNS {
	t.Helper()
	n := testutil.NewNetNS(t).NS
	err := n.Do(func(ns.NetNS) error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "eth1"}); err != nil {
			return err
		}
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, a := range c.Addresses {
			addr, err := netlink.ParseAddr(a.String())
			if err != nil {
				return err
			}
			addr.Flags = 0x80 // IFA_F_NODAD
			if err := netlink.AddrAdd(l, addr); err != nil {
				return err
			}
		}
		return netlink.LinkSetUp(l)
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func lo(fi int) netip.Addr {
	if fi == 1 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}
