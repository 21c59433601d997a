// Package daemon is the node agent's process supervision: it builds the agent
// and its servers (see Process) and runs them as Components — started in order,
// each once the one before is ready, stopped in reverse order, the first
// failure stopping them all. Adding a part of the process (a CNI installer, a
// node-readiness controller, a periodic verifier, an admin socket) is one
// Component and one line in Process.components.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
)

// Component is one long-running part of the process.
type Component interface {
	// Name names it in logs and errors.
	Name() string
	// Run runs until ctx ends and then returns nil; an error stops the
	// daemon. It calls ready once the components after it may start (a
	// listener bound, caches synced); returning before that aborts the
	// start.
	Run(ctx context.Context, ready func()) error
}

type staged struct {
	name string
	run  func(ctx context.Context, ready func()) error
}

func (s staged) Name() string                                { return s.name }
func (s staged) Run(ctx context.Context, ready func()) error { return s.run(ctx, ready) }

// Staged makes a Component of a function that says itself when it is ready.
func Staged(name string, run func(ctx context.Context, ready func()) error) Component {
	return staged{name, run}
}

// Func makes a Component of a function that is ready as soon as it starts.
func Func(name string, run func(ctx context.Context) error) Component {
	return staged{name, func(ctx context.Context, ready func()) error {
		ready()
		return run(ctx)
	}}
}

// ErrStoppedEarly is the failure of a component that returned nil while the
// daemon was running: nothing of the process may silently stop.
var ErrStoppedEarly = errors.New("stopped while the daemon was running")

type running struct {
	c      Component
	cancel context.CancelFunc
	done   chan error // receives Run's result once
}

// Run starts comps in order, each after the previous one called ready, and
// runs them until ctx ends (then it returns nil) or one of them fails or
// stops (then it returns that error). Either way every started component is
// stopped, the last started first, each one waited for before the next is
// told to stop: the CNI server stops taking pods before the agent stops
// syncing them, and the listeners go last.
func Run(ctx context.Context, log *slog.Logger, comps ...Component) error {
	exited := make(chan int, len(comps))
	var started []*running
	var failure error
	fail := func(r *running, err error) {
		if err == nil && ctx.Err() != nil {
			return // a clean stop
		}
		if failure == nil {
			if err == nil {
				err = ErrStoppedEarly
			}
			failure = fmt.Errorf("%s: %w", r.c.Name(), err)
		}
	}
start:
	for i, c := range comps {
		cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		r := &running{c: c, cancel: cancel, done: make(chan error, 1)}
		started = append(started, r)
		ready := make(chan struct{})
		var once sync.Once
		go func() {
			r.done <- c.Run(cctx, func() { once.Do(func() { close(ready) }) })
			exited <- i
		}()
		select {
		case <-ready:
			log.Debug("component ready", "component", c.Name())
		case j := <-exited: // this one, or one started before
			e := started[j]
			fail(e, <-e.done)
			e.done <- nil // for the shutdown below
			break start
		case <-ctx.Done():
			break start
		}
	}
	if failure == nil && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case j := <-exited:
			e := started[j]
			fail(e, <-e.done)
			e.done <- nil
		}
	}
	if failure != nil {
		log.Error("stopping", "error", failure)
	}
	for i := len(started) - 1; i >= 0; i-- {
		r := started[i]
		r.cancel()
		if err := <-r.done; err != nil {
			log.Warn("component stopped with an error", "component", r.c.Name(), "error", err)
		}
	}
	return failure
}
