package podnetns

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

func inodeOf(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestHandleDoEntersTheNamespace(t *testing.T) {
	pod := testutil.NewNetNS(t)
	h, err := Open(pod.NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	if h.Path() != pod.NS.Path() || h.Inode() != pod.Inode || !h.SameAs(pod.NS.Path()) || h.SameAs("/proc/self/ns/net") {
		t.Errorf("handle %v: path/inode/SameAs do not describe %s (inode %d)", h, pod.NS.Path(), pod.Inode)
	}
	var inside uint64
	if err := h.Do(func(ns.NetNS) error {
		inside = inodeOf(t, "/proc/thread-self/ns/net")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if inside != pod.Inode {
		t.Errorf("Do ran in netns inode %d, want %d", inside, pod.Inode)
	}
	// The calling goroutine's thread never moved.
	if got, want := inodeOf(t, "/proc/thread-self/ns/net"), inodeOf(t, "/proc/self/ns/net"); got != want {
		t.Errorf("caller's netns inode %d after Do, want the process's %d", got, want)
	}
	boom := errors.New("boom")
	if err := h.Do(func(ns.NetNS) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Errorf("second Close: %v (want nil: closed exactly once)", err)
	}
	err = h.Do(func(ns.NetNS) error { t.Error("fn ran on a closed handle"); return nil })
	if !errors.Is(err, ErrClosed) || !strings.Contains(err.Error(), pod.NS.Path()) {
		t.Errorf("Do after Close = %v, want ErrClosed naming %s", err, pod.NS.Path())
	}
	if h.Fd() != ^uintptr(0) {
		t.Error("Fd after Close is not invalid")
	}
}

func TestHandleCloseDuringDoWaitsForIt(t *testing.T) {
	pod := testutil.NewNetNS(t)
	h, err := Open(pod.NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Do(func(n ns.NetNS) error {
		h.Close() // e.g. the registry dropping the pod meanwhile
		var st unix.Stat_t
		if err := unix.Fstat(int(n.Fd()), &st); err != nil || st.Ino != pod.Inode {
			t.Errorf("descriptor inside Do after Close: ino %d, err %v; want still open", st.Ino, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if h.Fd() != ^uintptr(0) {
		t.Error("handle not closed once Do returned")
	}
}

// Open checks a path is a network namespace before opening it for reading:
// a FIFO (whose open would block), a device, a regular file, a directory and
// another kind of namespace are refused at once, naming the path.
func TestOpenRefusesNonNamespaces(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"", "/nonexistent/netns", "/etc/hostname", "/etc", "/dev/null", fifo, "/proc/self/ns/mnt", "/proc/self/environ"} {
		done := make(chan error, 1)
		go func() {
			h, err := Open(path)
			if err == nil {
				h.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("Open(%q): no error", path)
			} else if path != "" && !strings.Contains(err.Error(), path) {
				t.Errorf("Open(%q) = %v: error does not name the path", path, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("Open(%q) blocked: it opened the path before checking it", path)
		}
	}
	h, err := Open("/proc/self/ns/net")
	if err != nil {
		t.Fatalf("Open(/proc/self/ns/net): %v", err)
	}
	h.Close()
}
