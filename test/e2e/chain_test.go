//go:build e2e

package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestChainIsReal proves the CNI chain is the real one: host-local hands out
// an address on the bridge, two pods talk over it, DEL gives the address back
// and removes the veth.
func TestChainIsReal(t *testing.T) {
	ctx := testutil.Context(t, 3*time.Minute)
	chain := testEnv.PlainChain
	nsName := "chain-" + fmt.Sprint(time.Now().UnixNano()%1e6)
	if _, err := testEnv.CreateNamespace(ctx, nsName, nil); err != nil {
		t.Fatal(err)
	}

	mk := func(name string) *e2eenv.Pod {
		p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: name, Chain: chain})
		if err != nil {
			t.Fatalf("create pod %s: %v", name, err)
		}
		t.Cleanup(func() { _ = testEnv.DeletePod(ctx, p) })
		return p
	}
	a, b := mk("a"), mk("b")

	for _, p := range []*e2eenv.Pod{a, b} {
		if !chain.Subnet().Contains(p.IP()) {
			t.Fatalf("pod %s IP %s not in host-local subnet %s", p.Name, p.IP(), chain.Subnet())
		}
		// The address is on eth0 inside the pod's netns...
		var addrs []netlink.Addr
		if err := p.Do(func() error {
			link, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			addrs, err = netlink.AddrList(link, netlink.FAMILY_V4)
			return err
		}); err != nil {
			t.Fatalf("pod %s eth0: %v", p.Name, err)
		}
		if !slices.ContainsFunc(addrs, func(a netlink.Addr) bool { return a.IP.Equal(net.IP(p.IP().AsSlice())) }) {
			t.Fatalf("pod %s eth0 addresses %v lack %s", p.Name, addrs, p.IP())
		}
		// ...host-local recorded the lease...
		leases, err := chain.Leases()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(leases, p.IP()) {
			t.Fatalf("host-local leases %v lack pod %s's %s", leases, p.Name, p.IP())
		}
		// ...and the Pod object carries it, as the kubelet would report.
		if p.Object.Status.PodIP != p.IP().String() || p.Object.Spec.NodeName != testEnv.NodeName {
			t.Fatalf("pod %s status podIP %q nodeName %q", p.Name, p.Object.Status.PodIP, p.Object.Spec.NodeName)
		}
	}
	if a.IP() == b.IP() {
		t.Fatalf("both pods got %s", a.IP())
	}

	// The pods' veths hang off the bridge in the node netns.
	br, err := netlink.LinkByName(chain.Bridge())
	if err != nil {
		t.Fatalf("bridge %s in node netns: %v", chain.Bridge(), err)
	}
	ports := bridgePorts(t, br)
	if len(ports) < 2 {
		t.Fatalf("bridge %s has ports %v, want the two pods' veths", chain.Bridge(), ports)
	}

	// b listens inside its netns; a connects from inside its own, over the
	// bridge, and b sees a's address as the peer.
	l, err := b.Listen("tcp4", ":8080")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	peer := make(chan string, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			peer <- "accept: " + err.Error()
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(time.Minute))
		line, _ := bufio.NewReader(c).ReadString('\n')
		fmt.Fprintf(c, "hello %s", strings.TrimSpace(line))
		peer <- c.RemoteAddr().(*net.TCPAddr).IP.String()
	}()
	conn, err := a.Dial(ctx, "tcp4", netip.AddrPortFrom(b.IP(), 8080).String())
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	fmt.Fprintln(conn, "from-a")
	reply, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil && reply == "" {
		t.Fatalf("read reply from b: %v", err)
	}
	conn.Close()
	if reply != "hello from-a" {
		t.Fatalf("reply %q", reply)
	}
	if got := <-peer; got != a.IP().String() {
		t.Fatalf("b saw peer %s, want a's %s", got, a.IP())
	}

	// DEL releases the address and the veth; the netns and the Pod go.
	portsBefore := len(bridgePorts(t, br))
	if err := testEnv.DeletePod(ctx, a); err != nil {
		t.Fatalf("delete pod a: %v", err)
	}
	leases, err := chain.Leases()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(leases, a.IP()) || !slices.Contains(leases, b.IP()) {
		t.Fatalf("after DEL of a (%s): leases %v", a.IP(), leases)
	}
	if n := len(bridgePorts(t, br)); n != portsBefore-1 {
		t.Fatalf("bridge ports %d after DEL, want %d", n, portsBefore-1)
	}
	if _, err := os.Stat(a.NetnsPath); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("netns %s still there: %v", a.NetnsPath, err)
	}
	if _, err := testEnv.CP.Admin.CoreV1().Pods(nsName).Get(ctx, "a", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("pod a after delete: %v", err)
	}
	// A second DEL is fine, as runtimes repeat it.
	if err := chain.Del(ctx, a.Attachment()); err != nil {
		t.Fatalf("repeated DEL: %v", err)
	}
}

// TestChainBadNetns: ADD into a netns that does not exist fails with the
// bridge plugin's error, and leaves no lease and no Pod behind.
func TestChainBadNetns(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	chain := testEnv.PlainChain
	before, err := chain.Leases()
	if err != nil {
		t.Fatal(err)
	}
	att := e2eenv.Attachment{ContainerID: "bad-netns", NetnsPath: "/nonexistent/netns", PodName: "ghost", PodNamespace: "default", PodUID: "0000"}
	_, err = chain.Add(ctx, att)
	if err == nil {
		t.Fatal("ADD into a missing netns succeeded")
	}
	if _, ok := e2eenv.IsCNIError(err); !ok {
		t.Fatalf("error is not a CNI error result: %v", err)
	}
	t.Logf("ADD error (expected): %v", err)
	_ = chain.Del(ctx, att)
	after, err := chain.Leases()
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Fatalf("leases before %v, after failed ADD %v", before, after)
	}
}

func bridgePorts(t *testing.T, br netlink.Link) []string {
	t.Helper()
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range links {
		if l.Attrs().MasterIndex == br.Attrs().Index {
			out = append(out, l.Attrs().Name)
		}
	}
	return out
}

// TestNodeNetnsIsolation: the suite runs in its own node network namespace,
// and the chain's bridge exists only there, never in the machine's.
func TestNodeNetnsIsolation(t *testing.T) {
	// The parent is the same test binary, before it re-executed itself
	// under `ip netns exec`: its netns is the machine's.
	hostNS := fmt.Sprintf("/proc/%d/ns/net", os.Getppid())
	var self, host unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &self); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(hostNS, &host); err != nil {
		t.Fatal(err)
	}
	if self.Ino == host.Ino {
		t.Fatal("the e2e suite runs in the machine's own network namespace")
	}
	if os.Getenv(e2eenv.EnvNodeNetns) == "" {
		t.Fatalf("%s not set in the re-executed test binary", e2eenv.EnvNodeNetns)
	}
	// A pod through the chain makes sure the bridge exists here.
	ctx := testutil.Context(t, 2*time.Minute)
	nsName := "iso-" + fmt.Sprint(time.Now().UnixNano()%1e6)
	if _, err := testEnv.CreateNamespace(ctx, nsName, nil); err != nil {
		t.Fatal(err)
	}
	p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: "iso-probe", Chain: testEnv.PlainChain})
	if err != nil {
		t.Fatal(err)
	}
	defer testEnv.DeletePod(ctx, p)
	if _, err := netlink.LinkByName(testEnv.PlainChain.Bridge()); err != nil {
		t.Fatalf("bridge in node netns: %v", err)
	}
	// Look (read only) into the machine's netns.
	err = ns.WithNetNSPath(hostNS, func(ns.NetNS) error {
		_, err := netlink.LinkByName(testEnv.PlainChain.Bridge())
		return err
	})
	var notFound netlink.LinkNotFoundError
	if !errors.As(err, &notFound) {
		t.Fatalf("bridge %s in the machine's netns: lookup error %v, want link not found", testEnv.PlainChain.Bridge(), err)
	}
}
