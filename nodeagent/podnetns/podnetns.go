// Package podnetns finds the network namespace of running pods by scanning a
// host /proc tree: a pod's netns is the one of a process whose cgroup path names
// the pod uid and whose namespace holds one of the pod's IPs. The agent uses it
// for pods it has no CNI netns path for (restart, label added to a running pod).
//
// One call scans /proc once for any number of pods, so a restart with many pods
// costs one pass.
package podnetns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Target is a pod to look for.
type Target struct {
	// UID keys the result.
	UID string
	// RuntimeUID is the uid the pod's cgroup is named after, when it is
	// not UID: a static pod runs under its manifest's uid, while the API
	// (and the agent) know it by its mirror pod's.
	RuntimeUID string
	IPs        []netip.Addr
}

// cgroupUID is the uid t's cgroup names.
func (t Target) cgroupUID() string {
	if t.RuntimeUID != "" {
		return t.RuntimeUID
	}
	return t.UID
}

// Finder scans HostProc (usually /proc, or /host/proc in a container).
type Finder struct {
	HostProc string
	// addrs lists the addresses in the netns open as f; tests replace it.
	addrs func(f *os.File) ([]netip.Addr, error)
	// host are the node's own network namespaces: never a pod's.
	host []ID
}

// New returns a Finder for the /proc tree at hostProc.
func New(hostProc string) *Finder {
	return &Finder{HostProc: hostProc, addrs: netnsAddrs, host: HostNamespaces(hostProc)}
}

// Open opens the netns at path (Open); with the Finder's other methods it
// is everything the agent needs of pods' namespaces (agent.Netns).
func (f *Finder) Open(path string) (*Handle, error) { return Open(path) }

// HostNamespaces returns the network namespaces that are the node's own as
// this process sees them: its own (the agent runs in the host network) and
// that of pid 1 under hostProc (the host's init), whichever can be read.
func HostNamespaces(hostProc string) []ID {
	var out []ID
	for _, p := range []string{"/proc/self/ns/net", filepath.Join(hostProc, "1", "ns", "net")} {
		if id, err := IDOf(p); err == nil && !slices.Contains(out, id) {
			out = append(out, id)
		}
	}
	return out
}

// ErrHostNetns is returned for a namespace that is the node's own.
var ErrHostNetns = errors.New("the node's own network namespace, never a pod's")

// IsHost reports whether h is one of the node's own network namespaces.
func (f *Finder) IsHost(h *Handle) bool { return slices.Contains(f.host, h.ID()) }

// Accept checks a namespace found some other way than the /proc scan (the
// state file, a runtime's path) as the scan checks what it finds: not the
// node's own, and holding one of the pod's ips (an inode alone proves
// nothing: inode numbers are reused).
func (f *Finder) Accept(h *Handle, ips []netip.Addr) error {
	if f.IsHost(h) {
		return fmt.Errorf("netns %s: %w", h.Path(), ErrHostNetns)
	}
	ok, err := f.holds(h, ips)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("netns %s holds none of the pod's IPs %v", h.Path(), ips)
	}
	return nil
}

// Current reports whether h is still the pod's current sandbox: not the
// node's own namespace; the path it was opened from still names it (except
// a process's /proc/<pid>/ns/net: that process may exit while the sandbox
// lives on); and, when ips is not empty, it holds one of them (the pod's
// addresses as the API shows them now). A namespace the runtime removed, or
// one whose pod got new addresses, is not. why says what failed; err is set
// when the addresses could not be read (then ok is false too).
func (f *Finder) Current(h *Handle, ips []netip.Addr) (ok bool, why string, err error) {
	if f.IsHost(h) {
		return false, ErrHostNetns.Error(), nil
	}
	if !strings.HasPrefix(h.Path(), "/proc/") && !strings.HasPrefix(h.Path(), strings.TrimSuffix(f.HostProc, "/")+"/") && !h.SameAs(h.Path()) {
		return false, fmt.Sprintf("the runtime's netns path %s no longer names the namespace held (inode %d)", h.Path(), h.Inode()), nil
	}
	if len(ips) == 0 {
		return true, "", nil
	}
	held, err := f.holds(h, ips)
	if err != nil {
		return false, "", err
	}
	if !held {
		return false, fmt.Sprintf("the namespace held (%s) has none of the pod's IPs %v", h, ips), nil
	}
	return true, "", nil
}

// holds reports whether h's namespace has one of ips.
func (f *Finder) holds(h *Handle, ips []netip.Addr) (bool, error) {
	if !h.acquire() {
		return false, fmt.Errorf("netns %s: %w", h.path, ErrClosed)
	}
	defer h.release()
	addrs, err := f.addrs(h.f)
	if err != nil {
		return false, fmt.Errorf("list addresses of netns %s: %w", h.path, err)
	}
	return holdsAny(addrs, ips), nil
}

// Find scans HostProc once and returns, per uid found, an open Handle of
// /proc/<pid>/ns/net (the caller owns and closes it). Pods not found are simply
// absent from the map. Processes that vanish mid-scan are skipped. An error is
// returned only when HostProc itself cannot be read or ctx ends; the handles
// found so far are closed then.
func (f *Finder) Find(ctx context.Context, targets []Target) (map[string]*Handle, error) {
	found := make(map[string]*Handle)
	if len(targets) == 0 {
		return found, nil
	}
	dir, err := os.Open(f.HostProc)
	if err != nil {
		return nil, fmt.Errorf("podnetns: open host proc %s: %w", f.HostProc, err)
	}
	defer dir.Close()
	names, err := dir.Readdirnames(-1)
	if err != nil {
		return nil, fmt.Errorf("podnetns: list host proc %s: %w", f.HostProc, err)
	}
	// needles: both spellings of each uid; cgroupfs keeps dashes, the systemd
	// driver turns them into underscores.
	type want struct {
		t       Target
		needles [2]string
		tried   map[uint64]bool // netns inodes already checked for this pod
	}
	wants := make([]*want, 0, len(targets))
	for _, t := range targets {
		if t.UID == "" {
			continue
		}
		cg := t.cgroupUID()
		wants = append(wants, &want{t: t, needles: [2]string{cg, strings.ReplaceAll(cg, "-", "_")}, tried: map[uint64]bool{}})
	}
	closeAll := func() {
		for _, h := range found {
			h.Close()
		}
	}
	for _, name := range names {
		if _, err := strconv.Atoi(name); err != nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			closeAll()
			return nil, fmt.Errorf("podnetns: scan %s: %w", f.HostProc, err)
		}
		if len(found) == len(wants) {
			break
		}
		cg, err := readCgroup(filepath.Join(f.HostProc, name, "cgroup"))
		if err != nil {
			continue // process gone or unreadable
		}
		for _, w := range wants {
			if found[w.t.UID] != nil {
				continue
			}
			if !strings.Contains(cg, w.needles[0]) && !strings.Contains(cg, w.needles[1]) {
				continue
			}
			nsPath := filepath.Join(f.HostProc, name, "ns", "net")
			h, ok := f.check(nsPath, w.t.IPs, w.tried)
			if ok {
				found[w.t.UID] = h
			}
		}
	}
	return found, nil
}

// check opens nsPath and keeps it when that netns holds one of ips. tried
// avoids re-listing the same namespace for every process of the pod.
func (f *Finder) check(nsPath string, ips []netip.Addr, tried map[uint64]bool) (*Handle, bool) {
	h, err := os.Open(nsPath)
	if err != nil {
		return nil, false
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(h.Fd()), &st); err != nil || tried[st.Ino] || slices.Contains(f.host, ID{Dev: st.Dev, Ino: st.Ino}) {
		h.Close() // seen already, or the node's own: a hostNetwork pod's processes live there
		return nil, false
	}
	tried[st.Ino] = true
	addrs, err := f.addrs(h)
	if err != nil || !holdsAny(addrs, ips) {
		h.Close()
		return nil, false
	}
	nh, err := fromFile(h, nsPath)
	if err != nil {
		h.Close()
		return nil, false
	}
	return nh, true
}

func holdsAny(have, want []netip.Addr) bool {
	for _, w := range want {
		for _, h := range have {
			if h == w.Unmap() {
				return true
			}
		}
	}
	return false
}

// readCgroup reads a /proc/<pid>/cgroup file (small; bounded to 64 KiB).
func readCgroup(path string) (string, error) {
	fh, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer fh.Close()
	var b strings.Builder
	sc := bufio.NewScanner(fh)
	sc.Buffer(make([]byte, 0, 4096), 64<<10)
	for sc.Scan() {
		b.WriteString(sc.Text())
		b.WriteByte('\n')
	}
	return b.String(), sc.Err()
}

// netnsAddrs lists the addresses configured in the netns open as f, through a
// netlink socket created inside that namespace (no thread switching needed).
func netnsAddrs(f *os.File) ([]netip.Addr, error) {
	h, err := netlink.NewHandleAt(netns.NsHandle(int(f.Fd())))
	if err != nil {
		return nil, fmt.Errorf("netlink handle in %s: %w", f.Name(), err)
	}
	defer h.Close()
	list, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses in %s: %w", f.Name(), err)
	}
	out := make([]netip.Addr, 0, len(list))
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// ErrNotFound is returned by FindOne when the pod's netns is not found.
var ErrNotFound = errors.New("pod network namespace not found")

// FindOne is Find for a single pod.
func (f *Finder) FindOne(ctx context.Context, t Target) (*Handle, error) {
	m, err := f.Find(ctx, []Target{t})
	if err != nil {
		return nil, err
	}
	h, ok := m[t.UID]
	if !ok {
		return nil, fmt.Errorf("podnetns: pod %s (IPs %v) in %s: %w", t.UID, t.IPs, f.HostProc, ErrNotFound)
	}
	return h, nil
}
