// Package testutil holds small helpers shared by the tests of every package:
// one home for each (waits, bounded contexts, descriptor counts, required
// privileges and tools, throwaway network namespaces).
package testutil

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"
)

// Timeout bounds WaitFor: generous, since the machine running the tests is
// shared with builds and other suites. A test that waits for something that
// happens at once still finishes at once; only a failing one waits this long.
const Timeout = 30 * time.Second

// Context returns a context that ends after d, or when the test and its
// cleanups are done. It is not t.Context(): that one ends before the
// cleanups run, and cleanups (deleting what the test made) may use this one.
func Context(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// OpenFDs lists the file descriptors the process has open, to check that
// code under test does not leak them.
func OpenFDs(t testing.TB) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("reading /proc/self/fd: %v", err)
	}
	fds := make([]int, 0, len(ents))
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			fds = append(fds, fd)
		}
	}
	return fds
}

// CountFDs returns how many file descriptors the process has open.
func CountFDs(t testing.TB) int {
	t.Helper()
	return len(OpenFDs(t))
}

// WaitFor polls cond until it holds, failing the test with "timed out
// waiting for <what>" once Timeout has passed.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Eventually(t, what, Timeout, cond)
}

// Eventually is WaitFor with its own timeout.
func Eventually(t testing.TB, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	if !Wait(timeout, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Until polls cond until it holds, failing the test with "timed out waiting
// for <what>" once ctx ends (an end-to-end test's budget).
func Until(t testing.TB, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	if !poll(ctx, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Wait polls cond until it holds (true) or timeout has passed (false).
func Wait(timeout time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return poll(ctx, cond)
}

// poll is the one polling loop: the first checks come quickly (most
// conditions hold within milliseconds), later ones every maxPollInterval, so
// a condition that reads a status endpoint does not hammer it.
func poll(ctx context.Context, cond func() bool) bool {
	const maxPollInterval = 50 * time.Millisecond
	interval := 5 * time.Millisecond
	for !cond() {
		select {
		case <-ctx.Done():
			return cond()
		case <-time.After(interval):
		}
		interval = min(2*interval, maxPollInterval)
	}
	return true
}

// Logger returns a text logger writing each record at level or above to t.Log.
// It must not be used once the test has finished.
func Logger(t testing.TB, level slog.Level) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: level}))
}

// logWriter hands each record, without its newline, to t.Log.
type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p[:len(p)-1]))
	return len(p), nil
}

// Run runs run in a goroutine with a context of its own and returns stop,
// which cancels that context and waits up to Timeout for run to return,
// failing the test with run's error or when it does not return. stop does
// its work once; the test's cleanup calls it too.
func Run(t testing.TB, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	stop = sync.OnceFunc(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(Timeout):
			t.Errorf("run did not return within %v of its context's end", Timeout)
		}
	})
	t.Cleanup(stop)
	return stop
}
