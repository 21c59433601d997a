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
