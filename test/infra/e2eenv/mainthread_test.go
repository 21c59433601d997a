package e2eenv

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// Locking in init makes the test binary's main function (TestMain) run on
// the process's main thread, the one /proc/self describes.
func init() { runtime.LockOSThread() }

// mainThreadResult is what TestMain saw when it asked for a namespace change
// while running on the main thread; TestNamespaceChangeNeverOnMainThread
// reports it.
var mainThreadResult error

func TestMain(m *testing.M) {
	mainThreadResult = changeNetnsFromMainThread()
	os.Exit(m.Run())
}

// changeNetnsFromMainThread asks runLockedDisposable, from the main thread,
// to unshare a network namespace, and checks that it happened on another
// thread and that the process's own netns (/proc/self/ns/net) is unchanged.
func changeNetnsFromMainThread() error {
	if unix.Gettid() != unix.Getpid() {
		return fmt.Errorf("TestMain not on the main thread (tid %d, pid %d)", unix.Gettid(), unix.Getpid())
	}
	if os.Geteuid() != 0 {
		return nil // TestNamespaceChangeNeverOnMainThread fails through RequireRoot
	}
	var before, after unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &before); err != nil {
		return err
	}
	ranOn := 0
	err := runLockedDisposable(func() error {
		ranOn = unix.Gettid()
		return unix.Unshare(unix.CLONE_NEWNET)
	})
	if err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	if err := unix.Stat("/proc/self/ns/net", &after); err != nil {
		return err
	}
	switch {
	case ranOn == unix.Getpid():
		return fmt.Errorf("namespace change ran on the main thread")
	case before.Ino != after.Ino:
		return fmt.Errorf("process netns changed from %d to %d", before.Ino, after.Ino)
	}
	return nil
}
