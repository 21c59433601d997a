package cniinstall

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
)

// settle is how long Run lets a burst of file events (a rename, a chmod, a
// write) finish before it looks: one pass per burst, not one per event.
const settle = 100 * time.Millisecond

// Backoff of failed passes and of re-creating a failed watcher: from
// retryBase, doubling, at most retryMax.
const (
	retryBase = time.Second
	retryMax  = 30 * time.Second
)

// Run installs, then keeps the plugin installed until ctx ends, and returns
// nil then; it does not return before (a daemon component must not stop
// while the daemon runs). It never gives up: a pass that fails (the conf dir
// unusable, the binary unreadable, a config it must not edit) is retried
// with backoff, and the failure is what Check (readiness) reports until a
// pass succeeds. Changes are noticed through inotify on the conf and bin
// dirs; when a watcher cannot be had (inotify instances exhausted, the dir
// missing) or dies, Run polls every PollInterval and keeps trying to watch
// again. Returning leaves everything installed: only Uninstall removes it.
func (i *Installer) Run(ctx context.Context) error {
	r := &runner{i: i, guard: newLoopGuard(i.cfg.RepairWindow, i.cfg.RepairLimit)}
	defer r.stop()
	for _, d := range []string{i.cfg.ConfDir, i.cfg.BinDir} {
		_ = os.MkdirAll(d, 0o755) // to watch them; a failure is the pass's to report
	}
	r.watch()
	r.pass(true)
	resync := time.NewTicker(i.cfg.Resync)
	defer resync.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-r.events():
			switch {
			case !ok:
				r.lost(errors.New("watcher closed"))
			case r.dirGone(ev):
				r.lost(fmt.Errorf("%s was removed or renamed", ev.Name))
			case r.relevant(ev):
				r.soon(settle + r.guard.delay())
			}
		case err, ok := <-r.errors():
			if !ok {
				r.lost(errors.New("watcher closed"))
				continue
			}
			// An overflow loses events; a pass catches up.
			i.log.Warn("CNI config watcher error", "error", err)
			r.soon(settle)
		case <-r.pollC():
			r.pass(false)
		case <-r.rewatchC():
			r.rewatch = nil
			if r.watch() {
				r.pass(false) // what changed while we were not watching
			}
		case <-resync.C:
			r.pass(false)
		case <-r.due:
			r.due = nil
			r.pass(false)
		}
	}
}

// runner is Run's state.
type runner struct {
	i     *Installer
	guard *loopGuard
	w     *fsnotify.Watcher // nil while polling
	poll  *time.Ticker      // non-nil while polling
	// rewatch fires when it is time to try inotify again.
	rewatch      <-chan time.Time
	watchBackoff backoff
	// due fires the next pass (an event burst settled, or a retry).
	due         <-chan time.Time
	dueAt       time.Time // when due fires
	passBackoff backoff
}

func (r *runner) events() chan fsnotify.Event {
	if r.w == nil {
		return nil
	}
	return r.w.Events
}

func (r *runner) errors() chan error {
	if r.w == nil {
		return nil
	}
	return r.w.Errors
}

func (r *runner) pollC() <-chan time.Time {
	if r.poll == nil {
		return nil
	}
	return r.poll.C
}

func (r *runner) rewatchC() <-chan time.Time { return r.rewatch }

// soon schedules a pass after d unless one is due sooner (a file event
// during a long wait, such as the withdraw grace, is looked at now).
func (r *runner) soon(d time.Duration) {
	if at := time.Now().Add(d); r.due == nil || at.Before(r.dueAt) {
		r.due, r.dueAt = time.After(d), at
	}
}

// watch tries to watch the conf and bin dirs with inotify; on failure it
// polls and schedules another try. It reports whether it now watches.
func (r *runner) watch() bool {
	i := r.i
	w, err := newWatcher(i.cfg.ConfDir, i.cfg.BinDir)
	if err != nil {
		d := r.watchBackoff.next()
		r.startPolling(fmt.Sprintf("cannot watch: %v", err))
		i.log.Warn("cannot watch the CNI dirs; polling instead", "error", err,
			"poll_interval", i.cfg.PollInterval, "retry_watch_in", d)
		r.rewatch = time.After(d)
		return false
	}
	if r.poll != nil {
		r.poll.Stop()
		r.poll = nil
		i.log.Info("watching the CNI dirs again (inotify); polling stopped")
	}
	r.w = w
	r.watchBackoff.reset()
	i.setMode("inotify")
	return true
}

func newWatcher(dirs ...string) (*fsnotify.Watcher, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("inotify: %w", err)
	}
	for _, d := range dirs {
		// inotify watches a file as well; a conf dir that is a file must
		// not look watched.
		if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
			w.Close()
			if err == nil {
				err = fmt.Errorf("%s: not a directory", d)
			}
			return nil, err
		}
		if err := w.Add(d); err != nil {
			w.Close()
			return nil, fmt.Errorf("watching %s: %w", d, err)
		}
	}
	return w, nil
}

func (r *runner) startPolling(why string) {
	if r.poll == nil {
		r.poll = time.NewTicker(r.i.cfg.PollInterval)
	}
	r.i.setMode("polling: " + why)
}

// lost drops a watcher that stopped working, polls, and tries again later.
func (r *runner) lost(why error) {
	r.closeWatcher()
	d := r.watchBackoff.next()
	r.startPolling(fmt.Sprintf("watcher lost: %v", why))
	r.i.log.Warn("lost the CNI dirs watcher; polling instead", "reason", why, "retry_watch_in", d)
	r.rewatch = time.After(d)
	r.soon(settle)
}

func (r *runner) closeWatcher() {
	if r.w != nil {
		r.w.Close()
		r.w = nil
	}
}

func (r *runner) stop() {
	r.closeWatcher()
	if r.poll != nil {
		r.poll.Stop()
	}
}

// dirGone: the event says a watched dir itself went away (its watch is gone
// with it).
func (r *runner) dirGone(ev fsnotify.Event) bool {
	if !ev.Has(fsnotify.Remove) && !ev.Has(fsnotify.Rename) {
		return false
	}
	name := filepath.Clean(ev.Name)
	return name == filepath.Clean(r.i.cfg.ConfDir) || name == filepath.Clean(r.i.cfg.BinDir)
}

// relevant filters events: any config file in the conf dir, our binary in
// the bin dir; our own temp files are noise.
func (r *runner) relevant(ev fsnotify.Event) bool {
	i := r.i
	dir, name := filepath.Dir(ev.Name), filepath.Base(ev.Name)
	if strings.HasPrefix(name, ".") {
		return false
	}
	switch filepath.Clean(dir) {
	case filepath.Clean(i.cfg.ConfDir):
		return contains(confExtensions, filepath.Ext(name))
	case filepath.Clean(i.cfg.BinDir):
		return name == i.cfg.Entry.Type
	}
	return false
}

// pass runs Install once. A failure is recorded (Check reports it) and
// retried with backoff; a write after the first pass is a repair of someone
// else's change and counts against the loop guard.
func (r *runner) pass(first bool) {
	i := r.i
	changed, failed, err := i.install()
	switch {
	case err == nil:
		if first || changed {
			i.report(Installed)
		}
		if i.setHealth(nil) {
			i.log.Info("CNI installer working again")
		}
		r.passBackoff.reset()
	case errors.As(err, new(*withdrawPending)):
		// Our copy is in place; not a failure. Look again when the grace
		// ends (a file event sooner, if the primary is back).
		i.setHealth(nil)
		var wp *withdrawPending
		errors.As(err, &wp)
		r.soon(wp.left)
	case errors.Is(err, ErrNoConfig):
		i.setHealth(nil) // not a failure: Check says there is no config
		i.log.Info("waiting for the node's primary CNI config", "dir", i.cfg.ConfDir, "error", err)
	case errors.Is(err, errConflict):
		// Another writer kept changing the files under us: look again
		// once it settled; not a failure of ours.
		i.log.Info("CNI config kept changing during the pass; retrying", "error", err)
		r.soon(settle + r.guard.delay())
	default:
		i.report(failed)
		i.setHealth(err)
		d := r.passBackoff.next()
		i.log.Error("installing the CNI plugin failed; retrying", "error", err, "retry_in", d)
		r.due, r.dueAt = time.After(d), time.Now().Add(d)
	}
	if changed && !first {
		if n, fighting := r.guard.repaired(time.Now()); fighting {
			i.log.Warn("another component keeps rewriting the CNI config or plugin; re-inserting with backoff",
				"repairs", n, "window", i.cfg.RepairWindow, "retry_in", r.guard.delay())
		} else {
			i.log.Info("re-installed the CNI plugin after an external change", "repairs_in_window", n)
		}
	}
}

// setHealth records a pass's outcome; it reports whether this ended a
// failure.
func (i *Installer) setHealth(err error) (recovered bool) {
	i.hmu.Lock()
	defer i.hmu.Unlock()
	h := &i.health
	if err == nil {
		recovered = h.err != nil
		h.err, h.failures, h.since = nil, 0, time.Time{}
		return recovered
	}
	if h.err == nil {
		h.since = time.Now()
	}
	h.err = err
	h.failures++
	return false
}

func (i *Installer) setMode(mode string) {
	i.hmu.Lock()
	defer i.hmu.Unlock()
	i.health.mode = mode
}

// healthErr is the recorded failure as Check reports it (nil when the last
// pass worked).
func (i *Installer) healthErr() error {
	i.hmu.Lock()
	defer i.hmu.Unlock()
	h := i.health
	if h.err == nil {
		return nil
	}
	return fmt.Errorf("CNI installer failing since %s (%d attempts; retrying): %w", h.since.UTC().Format(time.RFC3339), h.failures, h.err)
}

// Watching says how the installer notices changes: "inotify", or
// "polling: <why>" (empty before Run).
func (i *Installer) Watching() string {
	i.hmu.Lock()
	defer i.hmu.Unlock()
	return i.health.mode
}

// backoff is a doubling delay from retryBase to retryMax.
type backoff struct{ d time.Duration }

func (b *backoff) next() time.Duration {
	b.d = min(max(2*b.d, retryBase), retryMax)
	return b.d
}

func (b *backoff) reset() { b.d = 0 }

// loopGuard counts repairs in a sliding window; above the limit, each
// further repair waits longer (doubling, capped), so two installers fighting
// over one file do not spin.
type loopGuard struct {
	window  time.Duration
	limit   int
	times   []time.Time
	backoff time.Duration
}

const maxBackoff = time.Minute

func newLoopGuard(window time.Duration, limit int) *loopGuard {
	return &loopGuard{window: window, limit: limit}
}

func (g *loopGuard) repaired(now time.Time) (n int, fighting bool) {
	keep := g.times[:0]
	for _, t := range g.times {
		if now.Sub(t) < g.window {
			keep = append(keep, t)
		}
	}
	g.times = append(keep, now)
	if len(g.times) <= g.limit {
		g.backoff = 0
		return len(g.times), false
	}
	g.backoff = min(max(2*g.backoff, time.Second), maxBackoff)
	return len(g.times), true
}

func (g *loopGuard) delay() time.Duration { return g.backoff }

func (i *Installer) setWithdrawn(name string) {
	i.hmu.Lock()
	defer i.hmu.Unlock()
	i.health.withdrawn = name
}

func (i *Installer) withdrawnPrimary() string {
	i.hmu.Lock()
	defer i.hmu.Unlock()
	return i.health.withdrawn
}
