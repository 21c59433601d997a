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

// Run installs, then watches the conf dir and the bin dir and repairs what
// another component changes, until ctx ends. With no config yet it waits for
// one. Returning leaves everything installed: only Uninstall removes it.
func (i *Installer) Run(ctx context.Context) error {
	for _, d := range []string{i.cfg.ConfDir, i.cfg.BinDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("cni install: creating %s: %w", d, err)
		}
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("cni install: watcher: %w", err)
	}
	defer w.Close()
	for _, d := range []string{i.cfg.ConfDir, i.cfg.BinDir} {
		if err := w.Add(d); err != nil {
			return fmt.Errorf("cni install: watching %s: %w", d, err)
		}
	}
	guard := newLoopGuard(i.cfg.RepairWindow, i.cfg.RepairLimit)
	i.pass(guard, true)
	resync := time.NewTicker(i.cfg.Resync)
	defer resync.Stop()
	var due <-chan time.Time // set while a pass is pending
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("cni install: watcher closed")
			}
			if i.relevant(ev) && due == nil {
				due = time.After(settle + guard.delay())
			}
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("cni install: watcher closed")
			}
			// An overflow loses events; the pass below catches up.
			i.log.Warn("CNI config watcher error", "error", err)
			if due == nil {
				due = time.After(settle)
			}
		case <-resync.C:
			i.pass(guard, false)
		case <-due:
			due = nil
			i.pass(guard, false)
		}
	}
}

// relevant filters events: any config file in the conf dir, our binary in
// the bin dir; our own temp files are noise.
func (i *Installer) relevant(ev fsnotify.Event) bool {
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

// pass runs Install once; a write after the first pass is a repair of
// someone else's change and counts against the loop guard.
func (i *Installer) pass(guard *loopGuard, first bool) {
	changed, err := i.Install()
	switch {
	case errors.Is(err, ErrNoConfig):
		i.log.Info("waiting for the node's primary CNI config", "dir", i.cfg.ConfDir, "reason", err)
	case err != nil:
		i.log.Error("installing the CNI plugin", "error", err)
	}
	if changed && !first {
		if n, fighting := guard.repaired(time.Now()); fighting {
			i.log.Warn("another component keeps rewriting the CNI config or plugin; re-inserting with backoff",
				"repairs", n, "window", i.cfg.RepairWindow, "next_delay", guard.delay())
		} else {
			i.log.Info("re-installed the CNI plugin after an external change", "repairs_in_window", n)
		}
	}
}

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
