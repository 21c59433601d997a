package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// Test doubles of the agent's dependencies, for unit tests of its logic: a
// ztunnel server that records requests, a rule manager that records calls, a
// successor backend, and fake /proc entries of pod sandboxes.

// fakeZtunnel records requests; it is "connected" when connected is true and
// nacks the uids in nack.
type fakeZtunnel struct {
	mu        sync.Mutex
	connected bool
	nack      map[string]string
	adds      []ztunnel.Workload
	attempts  map[string]int // AddWorkload calls per uid, failed ones too
	dels      []string
	delErr    error // when set, DelWorkload fails with it
	subs      []chan struct{}
	// statusSubs are signalled on connect and disconnect.
	statusSubs []chan struct{}
	// source is the agent's snapshot source; Run records what it holds when
	// the agent starts the ztunnel server (right after its restart rebuild),
	// as the first snapshot a connecting ztunnel would get.
	source    func() []ztunnel.SnapshotEntry
	firstSnap []ztunnel.SnapshotEntry
	snapTaken bool
}

func (z *fakeZtunnel) AddWorkload(_ context.Context, w ztunnel.Workload, netns *podnetns.Handle) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	if z.attempts == nil {
		z.attempts = map[string]int{}
	}
	z.attempts[w.UID]++
	if netns == nil {
		return errors.New("no netns")
	}
	if !z.connected {
		return fmt.Errorf("add %s: %w", w.UID, ztunnel.ErrNoZtunnel)
	}
	if msg, ok := z.nack[w.UID]; ok {
		return &ztunnel.NackError{Op: "add", UID: w.UID, Message: msg}
	}
	z.adds = append(z.adds, w)
	return nil
}

func (z *fakeZtunnel) DelWorkload(_ context.Context, uid string) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.dels = append(z.dels, uid)
	return z.delErr
}

func (z *fakeZtunnel) SubscribeSnapshotAcked() (<-chan struct{}, func()) { return z.subscribe(&z.subs) }

func (z *fakeZtunnel) SubscribeStatus() (<-chan struct{}, func()) { return z.subscribe(&z.statusSubs) }

func (z *fakeZtunnel) subscribe(to *[]chan struct{}) (<-chan struct{}, func()) {
	z.mu.Lock()
	defer z.mu.Unlock()
	ch := make(chan struct{}, 1)
	*to = append(*to, ch)
	return ch, func() {}
}

func (z *fakeZtunnel) Status() ztunnel.Status {
	z.mu.Lock()
	defer z.mu.Unlock()
	if z.connected {
		return ztunnel.Status{Connections: 1, SnapshotAcked: true, Serving: 1}
	}
	return ztunnel.Status{}
}

// disconnect simulates the ztunnel leaving.
func (z *fakeZtunnel) disconnect() {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.connected = false
	signalAll(z.statusSubs)
}

func signalAll(subs []chan struct{}) {
	for _, ch := range subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (z *fakeZtunnel) Run(ctx context.Context) error {
	if z.source != nil {
		snap := z.source()
		z.mu.Lock()
		z.firstSnap, z.snapTaken = snap, true
		z.mu.Unlock()
	}
	<-ctx.Done()
	return nil
}

// connect simulates a ztunnel connecting and acking its snapshot.
func (z *fakeZtunnel) connect() {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.connected = true
	signalAll(z.statusSubs)
	signalAll(z.subs)
}

func (z *fakeZtunnel) setNack(uid, msg string) {
	z.mu.Lock()
	defer z.mu.Unlock()
	if msg == "" {
		delete(z.nack, uid)
		return
	}
	z.nack[uid] = msg
}

func (z *fakeZtunnel) added(uid string) int {
	z.mu.Lock()
	defer z.mu.Unlock()
	n := 0
	for _, w := range z.adds {
		if w.UID == uid {
			n++
		}
	}
	return n
}

func (z *fakeZtunnel) tried(uid string) int {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.attempts[uid]
}

func (z *fakeZtunnel) deleted(uid string) bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return slices.Contains(z.dels, uid)
}

// fakeRules records what the agent asked of the rule manager.
type fakeRules struct {
	mu       sync.Mutex
	applyErr error
	applied  int
	deleted  int
	verified int
	drift    int // how many VerifyPod calls still report drift
	probes   map[string][]netip.Addr
	// deleteFails: how many DeletePod calls still fail.
	deleteFails int
	// touched lists the netns inodes every rule call was made for.
	touched []uint64
	// verifiedWith are the options of the last VerifyPod.
	verifiedWith iptables.PodOptions
}

func (r *fakeRules) touch(n ns.NetNS) {
	if h, ok := n.(*podnetns.Handle); ok {
		r.touched = append(r.touched, h.Inode())
	}
}

func (r *fakeRules) ApplyPod(_ context.Context, n ns.NetNS, _ iptables.PodOptions) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n.Fd() == 0 {
		return errors.New("bad netns")
	}
	r.touch(n)
	if r.applyErr != nil {
		return r.applyErr
	}
	r.applied++
	return nil
}

func (r *fakeRules) DeletePod(_ context.Context, n ns.NetNS) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.touch(n)
	if r.deleteFails > 0 {
		r.deleteFails--
		return errors.New("iptables: resource busy")
	}
	r.deleted++
	return nil
}

func (r *fakeRules) AddProbeIPs(_ context.Context, uid string, ips []netip.Addr) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.probes[uid] = ips
	return nil
}

func (r *fakeRules) RemoveProbeIPs(_ context.Context, uid string, _ []netip.Addr) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.probes, uid)
	return nil
}

// VerifyPod reports drift once per drifted() call, as wiped rules would.
func (r *fakeRules) VerifyPod(_ context.Context, n ns.NetNS, opts iptables.PodOptions) (iptables.Drift, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.touch(n)
	r.verified++
	r.verifiedWith = opts
	if r.drift > 0 {
		r.drift--
		return iptables.Drift{Missing: []string{"-A OUTPUT -j ISTIO_OUTPUT"}}, nil
	}
	return iptables.Drift{}, nil
}

func (r *fakeRules) PruneProbeIPs(_ context.Context, live map[string][]netip.Addr) (iptables.ProbeChanges, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	owner := func(m map[string][]netip.Addr) map[netip.Addr]string {
		out := map[netip.Addr]string{}
		for uid, ips := range m {
			for _, ip := range ips {
				out[ip] = uid
			}
		}
		return out
	}
	have, want := owner(r.probes), owner(live)
	var ch iptables.ProbeChanges
	for ip := range have {
		if _, ok := want[ip]; !ok {
			ch.Removed++
		}
	}
	for ip, uid := range want {
		switch cur, ok := have[ip]; {
		case !ok:
			ch.Added++
		case cur != uid:
			ch.Relabelled++
		}
	}
	r.probes = maps.Clone(live)
	return ch, nil
}

func (r *fakeRules) RepairHostRules(context.Context) (iptables.Drift, error) {
	return iptables.Drift{}, nil
}

func (r *fakeRules) DumpPod(_ context.Context, n ns.NetNS) (string, error) {
	return fmt.Sprintf("# rules of netns fd %d\n", n.Fd()), nil
}

func (r *fakeRules) counts() (applied, deleted, probes int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.applied, r.deleted, len(r.probes)
}

// fakeSuccessor records the pods whose rules were moved to it. fails
// fails every write; drift makes every write "succeed" while a rule is
// missing when read back.
type fakeSuccessor struct {
	mu    sync.Mutex
	opts  []iptables.PodOptions
	fails bool
	drift bool
}

func (s *fakeSuccessor) VerifyPod(_ context.Context, n ns.NetNS, _ iptables.PodOptions) (iptables.Drift, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n == nil || n.Fd() == 0 {
		return iptables.Drift{}, errors.New("bad netns")
	}
	if s.drift {
		return iptables.Drift{Missing: []string{"-A ISTIO_PRERT -p tcp -j REDIRECT --to-ports 15006"}}, nil
	}
	return iptables.Drift{}, nil
}

func (s *fakeSuccessor) ApplyPod(_ context.Context, n ns.NetNS, opts iptables.PodOptions) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n == nil || n.Fd() == 0 {
		return errors.New("bad netns")
	}
	if s.fails {
		return errors.New("iptables-restore: exit status 4")
	}
	s.opts = append(s.opts, opts)
	return nil
}

func (s *fakeSuccessor) moved() []iptables.PodOptions {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]iptables.PodOptions(nil), s.opts...)
}

// fakeSandbox adds to the fake host proc a "sandbox process" of pod uid whose
// cgroup names the uid (as kubelet's systemd driver does) and whose netns is
// the one at netnsPath (a test's pod netns; its lo holds 127.0.0.1).
func fakeSandbox(t *testing.T, hostProc string, pid int, uid, netnsPath string) {
	t.Helper()
	dir := filepath.Join(hostProc, strconv.Itoa(pid))
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	cg := "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/cri-containerd-abc.scope\n"
	if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cg), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(netnsPath, filepath.Join(dir, "ns", "net")); err != nil {
		t.Fatal(err)
	}
}

// fakePodNetns is the path of the pod netns behind fakeNetns: the test
// process's own namespace, opened by a path the node's own is never named
// by (the agent, like the real Finder, knows the node's as /proc/self/ns/net
// and <HostProc>/1/ns/net).
const fakePodNetns = "/proc/thread-self/ns/net"

// fakeNetns is the host's network namespaces for tests of the agent's
// logic, without root: every path opens as a real nsfs handle; the one
// opened as fakePodNetns is a pod's (the fake rules never enter it), any
// other is judged by the real Finder (so /proc/self/ns/net is the node's
// own); a pod's holds 127.0.0.1 only, as the harness's real pod netns does;
// and the embedded Finder scans an empty /proc, so no running pod is ever
// found. What it stands in for (telling namespaces apart, reading their
// addresses) is tested on real ones in podnetns and by the withRealNetns
// tests.
type fakeNetns struct {
	*podnetns.Finder
}

func (f *fakeNetns) IsHost(h *podnetns.Handle) bool {
	return h.Path() != fakePodNetns && f.Finder.IsHost(h)
}

// holds: a fakeNetns pod namespace holds 127.0.0.1 only.
func (*fakeNetns) holds(ips []netip.Addr) bool {
	return slices.Contains(ips, netip.MustParseAddr("127.0.0.1"))
}

func (f *fakeNetns) Accept(h *podnetns.Handle, ips []netip.Addr) error {
	if f.IsHost(h) {
		return fmt.Errorf("netns %s: %w", h.Path(), podnetns.ErrHostNetns)
	}
	if !f.holds(ips) {
		return fmt.Errorf("netns %s holds none of the pod's IPs %v", h.Path(), ips)
	}
	return nil
}

func (f *fakeNetns) Current(h *podnetns.Handle, ips []netip.Addr) (bool, string, error) {
	if f.IsHost(h) {
		return false, podnetns.ErrHostNetns.Error(), nil
	}
	if len(ips) > 0 && !f.holds(ips) {
		return false, fmt.Sprintf("the namespace held (%s) has none of the pod's IPs %v", h, ips), nil
	}
	return true, "", nil
}
