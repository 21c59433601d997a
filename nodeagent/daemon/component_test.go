package daemon

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// journal records what the components did, in order.
type journal struct {
	mu  sync.Mutex
	log []string
}

func (j *journal) add(s string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.log = append(j.log, s)
}

func (j *journal) entries() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.log)
}

// part is a component that records its start and stop; fail, when set, is
// returned once the component has started.
func part(j *journal, name string, fail <-chan error) Component {
	return Staged(name, func(ctx context.Context, ready func()) error {
		j.add("start " + name)
		ready()
		select {
		case <-ctx.Done():
			j.add("stop " + name)
			return nil
		case err := <-fail:
			j.add("fail " + name)
			return err
		}
	})
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// TestRunStartsInOrderStopsInReverse: a failing component stops the daemon
// with its error (named), and every component is stopped, last started first.
func TestRunStartsInOrderStopsInReverse(t *testing.T) {
	var j journal
	fail := make(chan error, 1)
	done := make(chan error, 1)
	go func() {
		done <- Run(context.Background(), quiet, part(&j, "a", nil), part(&j, "b", fail), part(&j, "c", nil))
	}()
	testutil.Eventually(t, "c started", 30*time.Second, func() bool { return slices.Contains(j.entries(), "start c") })
	fail <- errors.New("listen unix /run/x.sock: address in use")
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "b: listen unix /run/x.sock: address in use") {
			t.Errorf("Run = %v, want b's error, named", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after a component failed")
	}
	want := []string{"start a", "start b", "start c", "fail b", "stop c", "stop a"}
	if got := j.entries(); !slices.Equal(got, want) {
		t.Errorf("journal %v, want %v", got, want)
	}
}

// TestRunAbortsStartWhenAComponentCannotStart: a component that fails
// before it is ready (a bad listen address) stops the start: later ones never
// run, earlier ones are stopped.
func TestRunAbortsStartWhenAComponentCannotStart(t *testing.T) {
	var j journal
	bad := Func("bad", func(context.Context) error { return errors.New("no") })
	broken := Staged("broken", func(context.Context, func()) error { return errors.New("cannot bind") })
	err := Run(context.Background(), quiet, part(&j, "a", nil), broken, bad)
	if err == nil || !strings.Contains(err.Error(), "broken: cannot bind") {
		t.Errorf("Run = %v, want broken's error", err)
	}
	if got, want := j.entries(), []string{"start a", "stop a"}; !slices.Equal(got, want) {
		t.Errorf("journal %v, want %v", got, want)
	}
}

// TestRunStoppedEarlyIsAFailure: a component that returns nil while the
// daemon runs is an error, not a quiet stop.
func TestRunStoppedEarlyIsAFailure(t *testing.T) {
	err := Run(context.Background(), quiet, Func("quitter", func(context.Context) error { return nil }))
	if !errors.Is(err, ErrStoppedEarly) {
		t.Errorf("Run = %v, want ErrStoppedEarly", err)
	}
}

// TestRunCleanStop: ctx ending stops everything and Run returns nil.
func TestRunCleanStop(t *testing.T) {
	var j journal
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, quiet, part(&j, "a", nil), part(&j, "b", nil)) }()
	testutil.Eventually(t, "b started", 30*time.Second, func() bool { return slices.Contains(j.entries(), "start b") })
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v, want nil", err)
	}
	if got, want := j.entries(), []string{"start a", "start b", "stop b", "stop a"}; !slices.Equal(got, want) {
		t.Errorf("journal %v, want %v", got, want)
	}
}
