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

	errc := make(chan error, 1)
	// A fresh goroutine whose thread is thrown away afterwards (it stays
	// locked), so no thread of the program is ever left in the wrong netns.
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
			return
		}
		self := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind-mount netns at %s: %w", path, err)
			return
		}
		errc <- nil
	}()
	if err := <-errc; err != nil {
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

// unmountUnder lazily unmounts every mount point below dir (pod netns bind
// mounts left by a test that did not delete its pods), deepest first.
func unmountUnder(dir string) error {
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
		if err := unix.Unmount(targets[i], unix.MNT_DETACH); err != nil && err != unix.EINVAL && firstErr == nil {
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
