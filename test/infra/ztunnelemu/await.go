package ztunnelemu

import (
	"context"
	"time"
)

// AwaitTimeout bounds Await: as generous as testutil.Timeout (the emulator's
// binary does not link the testing helpers).
const AwaitTimeout = 30 * time.Second

// TB is the part of testing.TB that Await uses.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// Await is WaitFor for a test that runs the emulator in its own process: it
// returns the state once cond holds, and fails t naming what it waited for
// (with the last state) after AwaitTimeout.
func Await(t TB, e *Emulator, what string, cond func(State) bool) State {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), AwaitTimeout)
	defer cancel()
	if err := e.WaitFor(ctx, cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
	return e.State()
}
