package podnetns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

const (
	uidA = "6f1c3a9e-1111-4b7a-9c1e-0a0a0a0a0a0a"
	uidB = "7e2d4b0f-2222-4c8b-8d2f-0b0b0b0b0b0b"
)

// fakeProc builds a proc tree: each pid gets a cgroup file and an ns/net file
// whose content lists the addresses the fake netns holds.
type fakeProc struct {
	t    *testing.T
	root string
}

func newFakeProc(t *testing.T) *fakeProc {
	return &fakeProc{t: t, root: t.TempDir()}
}

func (p *fakeProc) add(pid int, cgroup string, addrs ...string) {
	p.t.Helper()
	dir := filepath.Join(p.root, fmt.Sprint(pid), "ns")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		p.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(p.root, fmt.Sprint(pid), "cgroup"), []byte(cgroup), 0o644); err != nil {
		p.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "net"), []byte(strings.Join(addrs, "\n")), 0o644); err != nil {
		p.t.Fatal(err)
	}
}

func fileAddrs(f *os.File) ([]netip.Addr, error) {
	b, err := os.ReadFile(f.Name())
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, s := range strings.Fields(string(b)) {
		out = append(out, netip.MustParseAddr(s))
	}
	return out, nil
}

func TestFindFakeProc(t *testing.T) {
	p := newFakeProc(t)
	systemdB := strings.ReplaceAll(uidB, "-", "_")
	// pid 10: pod A's pause process (cgroupfs driver, dashes).
	p.add(10, "0::/kubepods/besteffort/pod"+uidA+"/abc\n", "10.244.0.5", "127.0.0.1")
	// pid 11: a process naming pod B (systemd driver) but in the host netns:
	// the IP check must reject it.
	p.add(11, "0::/kubepods.slice/kubepods-pod"+systemdB+".slice/cri-containerd-1.scope\n", "192.168.1.10")
	// pid 12: pod B's real sandbox.
	p.add(12, "0::/kubepods.slice/kubepods-pod"+systemdB+".slice/cri-containerd-2.scope\n", "10.244.0.6", "fd00::6")
	// pid 13: unrelated process, same IP as pod A: no uid match, never chosen.
	p.add(13, "0::/system.slice/foo.service\n", "10.244.0.5")
	// non-numeric entries are ignored.
	if err := os.MkdirAll(filepath.Join(p.root, "self"), 0o755); err != nil {
		t.Fatal(err)
	}

	f := &Finder{HostProc: p.root, addrs: fileAddrs}
	got, err := f.Find(context.Background(), []Target{
		{UID: uidA, IPs: []netip.Addr{netip.MustParseAddr("10.244.0.5")}},
		{UID: uidB, IPs: []netip.Addr{netip.MustParseAddr("fd00::6")}},
		{UID: "00000000-0000-0000-0000-000000000000", IPs: []netip.Addr{netip.MustParseAddr("10.244.0.9")}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, h := range got {
			h.Close()
		}
	}()
	want := map[string]string{
		uidA: filepath.Join(p.root, "10", "ns", "net"),
		uidB: filepath.Join(p.root, "12", "ns", "net"),
	}
	if len(got) != len(want) {
		t.Fatalf("found %d pods, want %d: %v", len(got), len(want), got)
	}
	for uid, path := range want {
		if h := got[uid]; h == nil || h.Path() != path {
			t.Errorf("pod %s: got %v, want %s", uid, h, path)
		}
	}
}

func TestFindErrors(t *testing.T) {
	f := &Finder{HostProc: filepath.Join(t.TempDir(), "missing"), addrs: fileAddrs}
	if _, err := f.Find(context.Background(), []Target{{UID: uidA}}); err == nil {
		t.Error("missing host proc: no error")
	}
	p := newFakeProc(t)
	p.add(1, uidA, "10.0.0.1")
	f = &Finder{HostProc: p.root, addrs: fileAddrs}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := f.Find(ctx, []Target{{UID: uidA, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}}); !errors.Is(err, context.Canceled) {
		t.Errorf("canceled ctx: err = %v", err)
	}
	_, err := f.FindOne(context.Background(), Target{UID: uidB, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}})
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("FindOne unknown pod: err = %v, want ErrNotFound", err)
	}
}

// TestFindRealNetns runs a real process inside a real network namespace holding
// the pod IP and checks that the real /proc/<pid>/ns/net of that process is
// recognised by its addresses, while a decoy in the host netns is not. The
// cgroup file is faked (a test cannot easily place a process in a cgroup named
// after a pod), the namespace and address match are real.
func TestFindRealNetns(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "sleep")
	podNS, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("create netns: %v", err)
	}
	t.Cleanup(func() {
		podNS.Close()
		testutils.UnmountNS(podNS)
	})
	podIP := netip.MustParseAddr("10.99.0.7")
	var cmd *exec.Cmd
	err = podNS.Do(func(ns.NetNS) error {
		// The loopback device always exists (no dummy module needed).
		link, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return fmt.Errorf("set lo up: %w", err)
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: podIP.AsSlice(), Mask: net.CIDRMask(32, 32)}}
		if err := netlink.AddrAdd(link, addr); err != nil {
			return fmt.Errorf("add addr: %w", err)
		}
		// Started from this locked thread, the child inherits the pod netns.
		cmd = exec.Command("sleep", "300")
		return cmd.Start()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})

	root := t.TempDir()
	link := func(pid int, cgroup string, realPid int) {
		dir := filepath.Join(root, fmt.Sprint(pid), "ns")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, fmt.Sprint(pid), "cgroup"), []byte(cgroup), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(fmt.Sprintf("/proc/%d/ns/net", realPid), filepath.Join(dir, "net")); err != nil {
			t.Fatal(err)
		}
	}
	link(1, "0::/kubepods/pod"+uidA+"/decoy\n", os.Getpid()) // host netns: no pod IP
	link(2, "0::/kubepods.slice/kubepods-pod"+strings.ReplaceAll(uidA, "-", "_")+".slice/x.scope\n", cmd.Process.Pid)

	h, err := New(root).FindOne(context.Background(), Target{UID: uidA, IPs: []netip.Addr{podIP}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	// The handle must refer to the very namespace the test created.
	if !h.SameAs(podNS.Path()) {
		t.Errorf("found netns %s is not the pod's netns %s", h, podNS.Path())
	}
}

// addrNetns makes a real netns whose lo holds ip, and a process in it (so
// a /proc scan finds it); it returns the netns and the process's pid.
func addrNetns(t *testing.T, ip netip.Addr) (ns.NetNS, int) {
	t.Helper()
	testutil.RequireBinary(t, "sleep")
	// A test may remove the netns itself (as a runtime does).
	n := testutil.NewNetNSWith(t, testutil.NetNSOptions{IgnoreRemovalErr: true}).NS
	var cmd *exec.Cmd
	err := n.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())}}); err != nil {
			return err
		}
		cmd = exec.Command("sleep", "300")
		return cmd.Start()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return n, cmd.Process.Pid
}

// fakeCgroup makes a fake proc entry pid whose cgroup names uid and whose
// ns/net is realPid's.
func fakeCgroup(t *testing.T, root string, pid int, uid string, realPid int) {
	t.Helper()
	dir := filepath.Join(root, fmt.Sprint(pid), "ns")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, fmt.Sprint(pid), "cgroup"), []byte("0::/kubepods/besteffort/pod"+uid+"/c\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(fmt.Sprintf("/proc/%d/ns/net", realPid), filepath.Join(dir, "net")); err != nil {
		t.Fatal(err)
	}
}

// The host is never a pod: a hostNetwork pod's processes live in the node's
// netns, which holds the pod's IP (the node's). The scan must not return it;
// a pod netns holding the same address is found.
func TestFindNeverReturnsTheHost(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1") // held by the node's netns too
	root := t.TempDir()
	fakeCgroup(t, root, 10, uidA, os.Getpid()) // "hostNetwork pod": the test's own netns
	got, err := New(root).Find(context.Background(), []Target{{UID: uidA, IPs: []netip.Addr{lo}}})
	if err != nil {
		t.Fatal(err)
	}
	if h := got[uidA]; h != nil {
		h.Close()
		t.Fatalf("the scan returned the node's own netns %v for a pod", h)
	}
	podNS, pid := addrNetns(t, netip.MustParseAddr("10.99.0.8"))
	fakeCgroup(t, root, 11, uidA, pid)
	h, err := New(root).FindOne(context.Background(), Target{UID: uidA, IPs: []netip.Addr{netip.MustParseAddr("10.99.0.8")}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if !h.SameAs(podNS.Path()) {
		t.Errorf("found %v, want the pod's netns %s", h, podNS.Path())
	}
}

// Accept and Current: a namespace is the pod's only while it holds one of
// the pod's IPs, and (for a runtime path) while its path still names it;
// the node's own netns never is.
func TestAcceptAndCurrent(t *testing.T) {
	ip := netip.MustParseAddr("10.99.0.9")
	other := netip.MustParseAddr("10.99.0.10")
	podNS, _ := addrNetns(t, ip)
	f := New(t.TempDir())
	h, err := Open(podNS.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := f.Accept(h, []netip.Addr{ip}); err != nil {
		t.Errorf("Accept with the pod's IP: %v", err)
	}
	if err := f.Accept(h, []netip.Addr{other}); err == nil {
		t.Error("Accept of a netns without the pod's IP: no error")
	}
	if err := f.Accept(h, nil); err == nil {
		t.Error("Accept without IPs to check: no error")
	}
	if ok, why, err := f.Current(h, []netip.Addr{ip}); !ok || err != nil {
		t.Errorf("Current: %v %q %v", ok, why, err)
	}
	if ok, why, _ := f.Current(h, nil); !ok {
		t.Errorf("Current without IPs (path still there): %q", why)
	}
	if ok, why, _ := f.Current(h, []netip.Addr{other}); ok || !strings.Contains(why, "none of the pod's IPs") {
		t.Errorf("Current with another IP: %v %q", ok, why)
	}
	host, err := Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	if err := f.Accept(host, []netip.Addr{netip.MustParseAddr("127.0.0.1")}); !errors.Is(err, ErrHostNetns) {
		t.Errorf("Accept of the node's netns: %v, want ErrHostNetns", err)
	}
	if ok, _, _ := f.Current(host, nil); ok {
		t.Error("the node's netns is Current for a pod")
	}
	// The runtime removes the sandbox's netns: the handle keeps it alive,
	// but it is no longer the pod's.
	// (containerd unmounts lazily: the handle keeps the namespace open).
	if err := unix.Unmount(podNS.Path(), unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(podNS.Path()); err != nil {
		t.Fatal(err)
	}
	if ok, why, _ := f.Current(h, []netip.Addr{ip}); ok || !strings.Contains(why, "no longer names") {
		t.Errorf("Current after the path went: %v %q", ok, why)
	}
}

// BenchmarkFind scans a proc tree of 2000 processes for 100 pods in one pass,
// as a restart with 100 pods does (address listing faked: this measures the
// scan itself).
func BenchmarkFind(b *testing.B) {
	root := b.TempDir()
	var targets []Target
	for i := range 2000 {
		dir := filepath.Join(root, fmt.Sprint(i+1), "ns")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			b.Fatal(err)
		}
		uid := fmt.Sprintf("%08d-0000-4000-8000-000000000000", i)
		ip := netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
		cg := "0::/system.slice/other.service\n"
		if i%20 == 0 { // every 20th process is a pod sandbox
			cg = "0::/kubepods.slice/kubepods-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/x.scope\n"
			targets = append(targets, Target{UID: uid, IPs: []netip.Addr{ip}})
		}
		if err := os.WriteFile(filepath.Join(root, fmt.Sprint(i+1), "cgroup"), []byte(cg), 0o644); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "net"), []byte(ip.String()), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	f := &Finder{HostProc: root, addrs: fileAddrs}
	for b.Loop() {
		got, err := f.Find(context.Background(), targets)
		if err != nil || len(got) != len(targets) {
			b.Fatalf("found %d of %d: %v", len(got), len(targets), err)
		}
		for _, h := range got {
			h.Close()
		}
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/scan")
}

// BenchmarkCurrent is the sandbox check every sync of an enabled pod and
// every drift pass makes before reading rules: a stat of the runtime's path
// and a netlink address dump inside the held netns.
func BenchmarkCurrent(b *testing.B) {
	ip := netip.MustParseAddr("10.99.0.11")
	n := testutil.NewNetNS(b)
	if err := n.NS.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(32, 32)}})
	}); err != nil {
		b.Fatal(err)
	}
	h, err := Open(n.NS.Path())
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	f := New(b.TempDir())
	for b.Loop() {
		if ok, why, err := f.Current(h, []netip.Addr{ip}); !ok || err != nil {
			b.Fatalf("Current: %v %q %v", ok, why, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/check")
}

// TestFindRefusesANetnsWithoutThePodsIP: a process in the pod's cgroup that
// lives in another network namespace (one the pod's container joined, or a
// foreign process placed in the pod's cgroup) does not make that namespace
// the pod's: the scan accepts a namespace only if it holds one of the pod's
// IPs (as Istio's finder does since istio/istio#61211), and keeps looking for
// the one that does. Real namespaces, real addresses.
func TestFindRefusesANetnsWithoutThePodsIP(t *testing.T) {
	podIP, otherIP := netip.MustParseAddr("10.99.0.21"), netip.MustParseAddr("10.99.0.22")
	_, foreignPid := addrNetns(t, otherIP) // another pod's sandbox
	root := t.TempDir()
	fakeCgroup(t, root, 10, uidA, foreignPid) // listed first: scanned first
	if h, err := New(root).FindOne(context.Background(), Target{UID: uidA, IPs: []netip.Addr{podIP}}); err == nil {
		h.Close()
		t.Fatalf("the scan returned %v, a netns without the pod's IP %v", h, podIP)
	} else if !errors.Is(err, ErrNotFound) {
		t.Fatalf("FindOne: %v, want ErrNotFound", err)
	}
	podNS, podPid := addrNetns(t, podIP)
	fakeCgroup(t, root, 11, uidA, podPid)
	h, err := New(root).FindOne(context.Background(), Target{UID: uidA, IPs: []netip.Addr{podIP}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if !h.SameAs(podNS.Path()) {
		t.Errorf("found %v, want the pod's netns %s", h, podNS.Path())
	}
	if h, err := New(root).FindOne(context.Background(), Target{UID: uidA}); err == nil {
		h.Close()
		t.Errorf("a pod without IPs to check was found (%v)", h)
	}
}

// TestFindByRuntimeUID: a static pod's cgroup names the uid the kubelet
// runs it under, not its mirror pod's API uid; the scan looks for
// RuntimeUID and keys the result by UID.
func TestFindByRuntimeUID(t *testing.T) {
	const static = "6a1b2c3d4e5f60718293a4b5c6d7e8f9"
	p := newFakeProc(t)
	p.add(5, "0::/kubepods/besteffort/pod"+static+"/c\n", "10.0.0.5")
	f := New(p.root)
	f.addrs = fileAddrs
	got, err := f.Find(context.Background(), []Target{{UID: uidA, RuntimeUID: static, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range got {
		defer h.Close()
	}
	if got[uidA] == nil || len(got) != 1 {
		t.Fatalf("found %v, want the static pod under its API uid", got)
	}
	if got, _ := f.Find(context.Background(), []Target{{UID: uidA, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}}); len(got) != 0 {
		t.Errorf("found by its API uid %v, which no cgroup names", got)
	}
}
