package e2eenv

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// NewNetns creates a persistent network namespace bind-mounted at
// dir/name and returns it open. The namespace has nothing in it, not even lo
// up (the loopback CNI plugin does that, as for a real pod sandbox).
func NewNetns(dir, name string) (ns.NetNS, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create netns dir: %w", err)
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return nil, fmt.Errorf("create netns mount point: %w", err)
	}
	f.Close()

	err = onDisposableThread(func() error {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
		}
		self := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind-mount netns at %s: %w", path, err)
		}
		return nil
	})
	if err != nil {
		os.Remove(path)
		return nil, err
	}
	n, err := ns.GetNS(path)
	if err != nil {
		_ = unix.Unmount(path, unix.MNT_DETACH)
		os.Remove(path)
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	return n, nil
}

// onDisposableThread runs fn on an OS thread of its own that is thrown away
// afterwards (its goroutine exits still locked), so fn may change the
// thread's namespaces without ever leaving another goroutine in them.
func onDisposableThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		errc <- runLockedDisposable(fn)
	}()
	return <-errc
}

// runLockedDisposable runs fn on the calling goroutine's locked thread unless
// that thread is the main thread. Go never exits the main thread: a goroutine
// that ends locked to it wedges it instead, and /proc/self (what every other
// tool reads as "this process") is the main thread, so a namespace change
// there would leak into the whole process. On the main thread fn runs on
// another disposable thread; holding the main one locked meanwhile keeps the
// new goroutine off it, and it is unlocked afterwards unchanged.
func runLockedDisposable(fn func() error) error {
	if unix.Gettid() == unix.Getpid() {
		err := onDisposableThread(fn)
		runtime.UnlockOSThread()
		return err
	}
	return fn()
}

// DeleteNetns closes n, unmounts its bind mount and removes the mount point.
// The namespace itself goes away when nothing else holds it (the agent or
// the emulator may still hold an fd; that is theirs to close).
func DeleteNetns(n ns.NetNS) error {
	path := n.Path()
	n.Close()
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		return fmt.Errorf("unmount netns %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("remove netns mount point %s: %w", path, err)
	}
	return nil
}

// UnmountUnder lazily unmounts every mount point below dir (pod netns bind
// mounts left by a test that did not delete its pods), deepest first.
func UnmountUnder(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var targets []string
	prefix := strings.TrimSuffix(dir, "/") + "/"
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(unescapeMount(f[4]), prefix) {
			targets = append(targets, unescapeMount(f[4]))
		}
	}
	var firstErr error
	for i := len(targets) - 1; i >= 0; i-- {
		// EINVAL: not a mount point any more; ENOENT: listed but covered by a
		// later mount on a parent (the machine's own entries under a tmpfs of
		// the node's mount namespace), so not reachable and not ours.
		if err := unix.Unmount(targets[i], unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT && firstErr == nil {
			firstErr = fmt.Errorf("unmount %s: %w", targets[i], err)
		}
	}
	return firstErr
}

// unescapeMount undoes mountinfo's octal escapes (\040 for space etc.).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
