package cniinstall

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// helperEnv makes the test binary the inotify helper (see TestMain).
const helperEnv = "AMBIENTD_CNIINSTALL_INOTIFY_HELPER"

func TestMain(m *testing.M) {
	if dir := os.Getenv(helperEnv); dir != "" {
		os.Exit(inotifyHelper(dir))
	}
	os.Exit(m.Run())
}

// A pass that cannot work — here the conf dir path is a regular file, a
// real ENOTDIR from the kernel — makes Check fail with the reason, is
// retried with backoff (Run does not return: a daemon component must not
// stop), and readiness comes back by itself once the cause goes away.
func TestRunFailureMakesUnreadyAndRecovers(t *testing.T) {
	h := newHostTree(t)
	if err := os.RemoveAll(h.conf); err != nil {
		t.Fatal(err)
	}
	writeFile(t, h.conf, "not a directory", 0o644)
	i := h.installer(t)
	runInstaller(t, i)
	var reason string
	testutil.Eventually(t, "Check reports the installer failing", 10*time.Second, func() bool {
		err := i.Check()
		if err != nil {
			reason = err.Error()
		}
		return err != nil && strings.Contains(reason, "CNI installer failing") && strings.Contains(reason, "not a directory")
	})
	t.Logf("while the conf dir is a file: %s", reason)
	if err := i.Check(); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("Check = %v", err)
	}
	if w := i.Watching(); !strings.HasPrefix(w, "polling") {
		t.Errorf("watching %q while the conf dir cannot be watched, want polling", w)
	}
	// The cause goes away: the conf dir is a directory with the primary's config.
	if err := os.Remove(h.conf); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(h.conf, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	start := time.Now()
	testutil.Eventually(t, "installed once the conf dir is usable", 45*time.Second, func() bool { return i.Check() == nil })
	t.Logf("recovered %s after the fix", time.Since(start).Round(time.Millisecond))
	testutil.Eventually(t, "watching with inotify again", 45*time.Second, func() bool { return i.Watching() == "inotify" })
	// And it repairs through inotify again.
	if err := os.Remove(h.path(DefaultOwnedName)); err != nil {
		t.Fatal(err)
	}
	waitInstalled(t, i, "owned config re-created after the recovery")
}

// The conf dir turns unusable while the plugin is installed (immutable: no
// file can be created or renamed in it, even by root — as on a read-only
// mount): the primary then changes its config, the installer cannot follow
// it, and readiness says so with the kernel's reason, although the runtime's
// config still has our entry; once the dir is writable again the copy
// follows and readiness returns.
func TestRunUnusableConfDirWhileInstalled(t *testing.T) {
	testutil.RequireRoot(t)
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	i := h.installer(t)
	runInstaller(t, i)
	waitInstalled(t, i, "first install")
	setImmutable(t, h.conf, true)
	t.Cleanup(func() { setImmutable(t, h.conf, false) })
	// The primary rewrites its file in place (allowed: the file is not
	// immutable, only the directory).
	changed := strings.Replace(flannelConflist, `"name": "cbr0",`, `"name": "cbr0", "mtu": 1400,`, 1)
	if err := os.WriteFile(h.path("10-flannel.conflist"), []byte(changed), 0o644); err != nil {
		t.Fatal(err)
	}
	var reason string
	testutil.Eventually(t, "Check reports the failure", 10*time.Second, func() bool {
		err := i.Check()
		if err != nil {
			reason = err.Error()
		}
		return err != nil && strings.Contains(reason, "operation not permitted")
	})
	t.Logf("conf dir immutable: %s", reason)
	setImmutable(t, h.conf, false)
	testutil.Eventually(t, "copy follows the primary once the dir is writable", 45*time.Second, func() bool {
		b, _ := os.ReadFile(h.path(DefaultOwnedName))
		return strings.Contains(string(b), `"mtu": 1400`) && i.Check() == nil
	})
}

// fsImmutableFL is FS_IMMUTABLE_FL of linux/fs.h (the `chattr +i` flag).
const fsImmutableFL = 0x10

func setImmutable(t *testing.T, dir string, on bool) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	flags, err := unix.IoctlGetUint32(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		t.Fatalf("FS_IOC_GETFLAGS %s: %v", dir, err)
	}
	if on {
		flags |= fsImmutableFL
	} else {
		flags &^= fsImmutableFL
	}
	v := int(flags)
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.FS_IOC_SETFLAGS, v); err != nil {
		t.Fatalf("FS_IOC_SETFLAGS %s: %v", dir, err)
	}
}

// The conf dir itself is removed and made again (a host reprovisioning its
// CNI dirs): the watch on the old dir is gone with it; the installer
// notices, polls, watches the new dir, and installs into it.
func TestRunConfDirReplaced(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	i := h.installer(t)
	runInstaller(t, i)
	waitInstalled(t, i, "first install")
	if err := os.RemoveAll(h.conf); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "polling after the dir went", 10*time.Second, func() bool { return strings.HasPrefix(i.Watching(), "polling") })
	if err := os.MkdirAll(h.conf, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	waitInstalled(t, i, "installed into the new conf dir")
	testutil.Eventually(t, "watching the new dir", 45*time.Second, func() bool { return i.Watching() == "inotify" })
	if err := os.Remove(h.path(DefaultOwnedName)); err != nil {
		t.Fatal(err)
	}
	waitInstalled(t, i, "owned config re-created through the new watch")
}

// helperStatus is what the inotify helper reports, one JSON line at a time.
type helperStatus struct {
	Watching string `json:"watching"`
	Check    string `json:"check"`
}

// Inotify instances exhausted, for real: the installer runs in a process
// of its own user namespace whose inotify instance limit
// (/proc/sys/user/max_inotify_instances, per user namespace) is 1, and that
// one instance is held by another watcher. The installer cannot watch, so
// it polls — and polling repairs: our owned config, deleted, comes back
// within a poll interval. When the other watcher lets its instance go, the
// installer watches with inotify again by itself, and repairs through it.
func TestInotifyExhaustedFallsBackToPolling(t *testing.T) {
	testutil.RequireRoot(t)
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+h.root)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: 1}},
		Pdeathsig:   syscall.SIGKILL,
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("helper: %v\n%s", err, stderr.String())
		}
	})
	var mu sync.Mutex
	var last helperStatus
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var st helperStatus
			if json.Unmarshal(sc.Bytes(), &st) == nil {
				mu.Lock()
				last = st
				mu.Unlock()
			}
		}
	}()
	status := func() helperStatus { mu.Lock(); defer mu.Unlock(); return last }
	wait := func(what string, cond func(helperStatus) bool) {
		t.Helper()
		if !testutil.Wait(30*time.Second, func() bool { return cond(status()) }) {
			t.Fatalf("%s: last status %+v; helper log:\n%s", what, status(), stderr.String())
		}
	}
	wait("installed while polling", func(s helperStatus) bool {
		return s.Check == "" && strings.HasPrefix(s.Watching, "polling") && strings.Contains(s.Watching, "too many open files")
	})
	t.Logf("inotify exhausted: %q", status().Watching)
	removed := time.Now()
	if err := os.Remove(h.path(DefaultOwnedName)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "owned config re-created by polling", 30*time.Second, func() bool { return exists(h.path(DefaultOwnedName)) })
	t.Logf("polling repaired a deleted owned config in %s (poll interval 200ms)", time.Since(removed).Round(time.Millisecond))

	if _, err := io.WriteString(stdin, "release\n"); err != nil {
		t.Fatal(err)
	}
	wait("watching with inotify once an instance is free", func(s helperStatus) bool { return s.Watching == "inotify" && s.Check == "" })
	removed = time.Now()
	if err := os.Remove(h.path(DefaultOwnedName)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "owned config re-created through inotify", 30*time.Second, func() bool { return exists(h.path(DefaultOwnedName)) })
	t.Logf("inotify repaired a deleted owned config in %s", time.Since(removed).Round(time.Millisecond))
}

// inotifyHelper is TestInotifyExhaustedFallsBackToPolling's other process,
// in its own user namespace: it caps inotify instances at 1, takes that
// one, runs the installer on the host tree under root, and reports the
// installer's state as JSON lines on stdout every 50ms. "release" on stdin
// frees the instance; EOF ends it.
func inotifyHelper(root string) int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "inotify helper: "+format+"\n", args...)
		return 1
	}
	if err := os.WriteFile("/proc/sys/user/max_inotify_instances", []byte("1"), 0o644); err != nil {
		return fail("setting the user namespace's inotify limit: %v", err)
	}
	hog, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		return fail("taking the one inotify instance: %v", err)
	}
	if w, err := fsnotify.NewWatcher(); err == nil {
		w.Close()
		return fail("a second inotify instance was granted: the limit does not hold")
	}
	h := hostTree{root: root, bin: filepath.Join(root, "opt/cni/bin"), conf: filepath.Join(root, "etc/cni/net.d"), src: filepath.Join(root, "image/ambientd-cni")}
	cfg := h.config()
	cfg.PollInterval = 200 * time.Millisecond
	i, err := New(cfg, slog.New(slog.NewTextHandler(os.Stderr, nil)))
	if err != nil {
		return fail("%v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- i.Run(ctx) }()
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	enc := json.NewEncoder(os.Stdout)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				cancel()
				if err := <-done; err != nil {
					return fail("Run: %v", err)
				}
				return 0
			}
			if l == "release" {
				unix.Close(hog)
			}
		case <-tick.C:
			st := helperStatus{Watching: i.Watching()}
			if err := i.Check(); err != nil {
				st.Check = err.Error()
			}
			if err := enc.Encode(st); err != nil {
				return fail("stdout: %v", err)
			}
		}
	}
}
