package podnetns

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// Handle is the one owner of an open pod network namespace: the file, the
// path it was opened from (what every error names, never /proc/self/fd/N)
// and its identity. It implements ns.NetNS, so the iptables API takes it as
// it is. A Handle is used by pointer; Close closes the file exactly once and
// every later use fails cleanly (no copy can hold a closed descriptor).
type Handle struct {
	path     string
	dev, ino uint64

	f *os.File

	mu      sync.Mutex
	users   int  // Do/Set calls using the descriptor now
	closing bool // Close was called
	closed  bool // the file is closed (closing, and no user left)
}

var _ ns.NetNS = (*Handle)(nil)

// ErrClosed is returned by a Handle used after Close.
var ErrClosed = errors.New("netns handle closed")

// Open opens the network namespace at path (a runtime's bind mount such as
// /var/run/netns/cni-…, or /proc/<pid>/ns/net). The path is checked before
// anything is opened for reading: it is resolved with O_PATH (which neither
// blocks on a FIFO nor has a device's open side effects) and must be on
// nsfs; only then is it opened, through that O_PATH descriptor (so the same
// file), and the kernel asked that it is a network namespace
// (NS_GET_NSTYPE). Anything else is refused with an error naming path.
func Open(path string) (*Handle, error) {
	if path == "" {
		return nil, errors.New("no netns path")
	}
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	var sfs unix.Statfs_t
	err = unix.Fstatfs(fd, &sfs)
	if err == nil && sfs.Type != unix.NSFS_MAGIC {
		err = fmt.Errorf("%s is not a network namespace (filesystem type %#x, not nsfs)", path, sfs.Type)
	} else if err != nil {
		err = fmt.Errorf("statfs netns %s: %w", path, err)
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	f, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", fd), os.O_RDONLY, 0)
	unix.Close(fd)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	if t, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_NSTYPE); err != nil || t != unix.CLONE_NEWNET {
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("netns %s: namespace type: %w", path, err)
		}
		return nil, fmt.Errorf("%s is a namespace but not a network namespace (type %#x)", path, t)
	}
	h, err := fromFile(f, path)
	if err != nil {
		f.Close()
		return nil, err
	}
	return h, nil
}

// fromFile makes a Handle of f, opened from path. The /proc finder uses it
// directly: a /proc/<pid>/ns/net it opened is a netns by construction.
func fromFile(f *os.File, path string) (*Handle, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat netns %s: %w", path, err)
	}
	return &Handle{path: path, dev: st.Dev, ino: st.Ino, f: f}, nil
}

// Path is the path the namespace was opened from (ns.NetNS).
func (h *Handle) Path() string { return h.path }

// Inode is the namespace's inode number (what ztunnel and tests report).
func (h *Handle) Inode() uint64 { return h.ino }

// ID identifies the namespace.
func (h *Handle) ID() ID { return ID{Dev: h.dev, Ino: h.ino} }

// ID identifies a namespace: the device and inode of its nsfs file.
type ID struct{ Dev, Ino uint64 }

// IDOf returns the ID of the namespace at path.
func IDOf(path string) (ID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return ID{}, err
	}
	return ID{Dev: st.Dev, Ino: st.Ino}, nil
}

// String names the handle in logs.
func (h *Handle) String() string { return fmt.Sprintf("%s (inode %d)", h.path, h.ino) }

// Fd returns the open descriptor (ns.NetNS); ^uintptr(0) once closed.
func (h *Handle) Fd() uintptr {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return ^uintptr(0)
	}
	return h.f.Fd()
}

// acquire marks the descriptor in use, so a concurrent Close defers the
// actual close to release; false when the handle is closed.
func (h *Handle) acquire() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return false
	}
	h.users++
	return true
}

func (h *Handle) release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.users--
	if h.closing && h.users == 0 && !h.closed {
		h.closed = true
		h.f.Close()
	}
}

// File returns the open file, for passing the namespace on (SCM_RIGHTS). The
// Handle still owns it: sending a file closed meanwhile fails with
// os.ErrClosed, never with another namespace's descriptor.
func (h *Handle) File() *os.File { return h.f }

// SameAs reports whether path is (now) this namespace. A path that is gone
// matches nothing.
func (h *Handle) SameAs(path string) bool {
	var st unix.Stat_t
	if path == "" || unix.Stat(path, &st) != nil {
		return false
	}
	return st.Dev == h.dev && st.Ino == h.ino
}

// Close closes the namespace file once (after any Do in flight returns);
// later calls return nil. It never blocks.
func (h *Handle) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return nil
	}
	h.closing = true
	if h.users > 0 {
		return nil // the last user closes it
	}
	h.closed = true
	return h.f.Close()
}

// Set switches the calling thread into the namespace (ns.NetNS). Callers
// must have locked the thread; Do is what code should use.
func (h *Handle) Set() error {
	if !h.acquire() {
		return fmt.Errorf("enter netns %s: %w", h.path, ErrClosed)
	}
	defer h.release()
	if err := unix.Setns(int(h.f.Fd()), unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("enter netns %s: %w", h.path, err)
	}
	return nil
}

// Do runs fn inside the namespace on a fresh goroutine locked to its OS
// thread, entered straight from the open descriptor (the path may be gone).
// If the thread cannot be switched back, it is never reused: the goroutine
// exits still locked and Go retires the thread.
func (h *Handle) Do(fn func(ns.NetNS) error) error {
	if !h.acquire() {
		return fmt.Errorf("netns %s: %w", h.path, ErrClosed)
	}
	defer h.release()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns %s: open current netns: %w", h.path, err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(h.f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns %s: %w", h.path, err)
			return
		}
		ferr := fn(h)
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: it dies with this goroutine.
			errc <- errors.Join(ferr, fmt.Errorf("leave netns %s: %w", h.path, err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
