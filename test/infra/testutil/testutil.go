package testutil

import (
	"log/slog"
	"os"
	"testing"
	"time"
)

// CountFDs returns how many file descriptors the process has open, to check
// that code under test does not leak them.
func CountFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("reading /proc/self/fd: %v", err)
	}
	return len(ents)
}

// Eventually polls cond until it holds, failing the test with "timed out
// waiting for <what>" once timeout has passed.
func Eventually(t testing.TB, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	if !Wait(timeout, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Wait polls cond until it holds (true) or timeout has passed (false).
func Wait(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
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
