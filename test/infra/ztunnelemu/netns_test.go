package ztunnelemu

import (
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/testutil"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// The emulator enters the netns it received, listens on ztunnel's ports
// there with ztunnel's socket options, and reports original destinations of
// REDIRECTed connections, and answers REDIRECTed DNS on ztunnel's DNS port.
// Del closes the listeners.
func TestNetnsModeListensInReceivedNetns(t *testing.T) {
	testutil.RequireBinary(t, "iptables")
	n := newNetns(t)
	// In the test's own netns only: send TCP to 10.99.0.1:80 to the
	// outbound listener, as the in-pod rules would.
	if err := n.NS.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(10, 99, 0, 1), Mask: net.CIDRMask(32, 32)}}); err != nil {
			return err
		}
		ipt, err := iptables.New()
		if err != nil {
			return err
		}
		if err := ipt.Append("nat", "OUTPUT", "-p", "tcp", "-d", "10.99.0.1", "--dport", "80", "-j", "REDIRECT", "--to-ports", "15001"); err != nil {
			return err
		}
		// And DNS to the DNS port, as the in-pod rules capture it.
		return ipt.Append("nat", "OUTPUT", "-p", "udp", "-d", "10.99.0.1", "--dport", "53", "-j", "REDIRECT", "--to-ports", "15053")
	}); err != nil {
		t.Fatalf("set up netns: %v", err)
	}

	a := newFakeAgent(t)
	e, _ := runEmu(t, Config{SocketPath: a.path, NetnsMode: true})
	c := a.accept()
	ack(t, c, zp.SnapshotSentRequest(), nil)
	if got := ack(t, c, zp.AddRequest("uid-1", info), n.File); got != "" {
		t.Fatalf("add: %q", got)
	}
	w, ok := e.State().Workload("uid-1")
	if !ok || w.NetnsInode != n.Inode {
		t.Fatalf("workload %+v, want netns inode %d", w, n.Inode)
	}
	_, hasV6 := os.Stat("/proc/sys/net/ipv6")
	wantListeners := 3
	if hasV6 == nil {
		wantListeners = 6
	}
	if len(w.Listeners) != wantListeners {
		t.Fatalf("listeners %v, want %d", w.Listeners, wantListeners)
	}

	// Socket options as ztunnel sets them.
	e.mu.Lock()
	ls := e.workloads["uid-1"].listeners
	e.mu.Unlock()
	for _, l := range ls {
		rc, err := l.Listener.(*net.TCPListener).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var mark, reuse int
		var serr error
		if err := rc.Control(func(fd uintptr) {
			if mark, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK); serr != nil {
				return
			}
			reuse, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT)
		}); err != nil || serr != nil {
			t.Fatal(err, serr)
		}
		if mark != 0x539 || reuse != 1 {
			t.Fatalf("listener %s: SO_MARK %#x SO_REUSEPORT %d", l.addr, mark, reuse)
		}
	}

	// Reachable from inside the netns, each port answering for itself.
	for _, port := range []string{"15001", "15006", "15008"} {
		line, err := n.dial(t, "127.0.0.1:"+port)
		if err != nil || !strings.Contains(line, "listener="+port) || !strings.Contains(line, "uid=uid-1") {
			t.Fatalf("dial %s in netns: %q %v", port, line, err)
		}
		if hasV6 == nil {
			line, err := n.dial(t, "[::1]:"+port)
			if err != nil || !strings.Contains(line, "listener="+port) {
				t.Fatalf("dial [::1]:%s in netns: %q %v", port, line, err)
			}
		}
	}
	// Not reachable from the test's (root) netns: the listeners live in
	// the pod's netns. (Nothing else on this machine uses 15006 on lo.)
	if c, err := net.DialTimeout("tcp", "127.0.0.1:15006", time.Second); err == nil {
		c.Close()
		t.Fatal("port 15006 reachable outside the workload netns")
	}
	// REDIRECTed traffic: original destination recovered.
	line, err := n.dial(t, "10.99.0.1:80")
	if err != nil || !strings.Contains(line, "listener=15001") || !strings.Contains(line, "orig_dst=10.99.0.1:80") {
		t.Fatalf("redirected dial: %q %v", line, err)
	}
	st := e.State()
	last := st.Accepted[len(st.Accepted)-1]
	if last.UID != "uid-1" || last.Port != 15001 || last.OrigDst != "10.99.0.1:80" {
		t.Fatalf("accept record: %+v", last)
	}
	// Without NAT, conntrack reports the real destination (or nothing).
	if first := st.Accepted[0]; first.OrigDst != first.Local && first.OrigDstError == "" {
		t.Fatalf("un-NATed connection: original dst should be the local address: %+v", first)
	}

	// A redirected DNS query is answered by the DNS port, for this
	// workload.
	if line, err := n.query(t, "10.99.0.1:53"); err != nil || !strings.Contains(line, "listener=15053") || !strings.Contains(line, "uid=uid-1") {
		t.Fatalf("redirected DNS query: %q %v", line, err)
	}

	// Del closes the listeners and the DNS port.
	ack(t, c, zp.DelRequest("uid-1"), nil)
	if _, err := n.dial(t, "127.0.0.1:15006"); err == nil {
		t.Fatal("listener still open after Del")
	}
	if line, err := n.query(t, "10.99.0.1:53"); err == nil {
		t.Fatalf("DNS port still answers after Del: %q", line)
	}
}
