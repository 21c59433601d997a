package testutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
)

func TestNewNetNS(t *testing.T) {
	var path string
	t.Run("make", func(t *testing.T) {
		for _, loDown := range []bool{false, true} {
			n := NewNetNSWith(t, NetNSOptions{LoDown: loDown})
			path = n.NS.Path()
			if _, err := os.Stat(path); err != nil {
				t.Fatal(err)
			}
			var up bool
			if err := n.NS.Do(func(ns.NetNS) error {
				lo, err := netlink.LinkByName("lo")
				up = err == nil && lo.Attrs().Flags&net.FlagUp != 0
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if up == loDown {
				t.Errorf("LoDown %v: lo up = %v", loDown, up)
			}
			if n.Inode == 0 || n.File == nil {
				t.Errorf("netns %+v", n)
			}
		}
	})
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still there after cleanup: %v", path, err)
	}
}

func TestCountFDs(t *testing.T) {
	before := CountFDs(t)
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	if got := CountFDs(t); got != before+1 {
		t.Errorf("after one open: %d, want %d", got, before+1)
	}
	f.Close()
	if got := CountFDs(t); got != before {
		t.Errorf("after close: %d, want %d", got, before)
	}
}

func TestEventually(t *testing.T) {
	start := time.Now()
	Eventually(t, "50ms", time.Minute, func() bool { return time.Since(start) > 50*time.Millisecond })
}

// fatalRecorder is a testing.TB whose Fatalf only records the message.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
}

// TestEventuallyTimesOut: a condition that never holds fails the test, with a
// message naming what was awaited, once the timeout has passed.
func TestEventuallyTimesOut(t *testing.T) {
	rec := &fatalRecorder{TB: t}
	calls := 0
	Eventually(rec, "the impossible", 30*time.Millisecond, func() bool { calls++; return false })
	if rec.msg != "timed out waiting for the impossible" {
		t.Errorf("Fatalf message %q, want %q", rec.msg, "timed out waiting for the impossible")
	}
	if calls < 2 {
		t.Errorf("condition polled %d times, want it retried until the timeout", calls)
	}
	if Wait(10*time.Millisecond, func() bool { return false }) {
		t.Error("Wait of a condition that never holds = true")
	}
}

// errRecorder is a testing.TB whose Errorf only records the message.
type errRecorder struct {
	testing.TB
	msgs []string
}

func (r *errRecorder) Helper()                   {}
func (r *errRecorder) Cleanup(func())            {}
func (r *errRecorder) Errorf(f string, a ...any) { r.msgs = append(r.msgs, fmt.Sprintf(f, a...)) }

// TestRun: stop ends the run's context and waits for it; an error the run
// returns fails the test; a second stop does nothing.
func TestRun(t *testing.T) {
	rec := &errRecorder{TB: t}
	ended := false
	stop := Run(rec, func(ctx context.Context) error {
		<-ctx.Done()
		ended = true
		return errors.New("boom")
	})
	stop()
	stop()
	if !ended {
		t.Error("stop returned before the run did")
	}
	if len(rec.msgs) != 1 || rec.msgs[0] != "run: boom" {
		t.Errorf("reported %q, want exactly the run's error once", rec.msgs)
	}
}
