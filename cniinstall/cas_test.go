package cniinstall

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// versioned is the primary's config as its writer's write number v makes it.
func versioned(v int64) string {
	return strings.Replace(flannelConflist, `"cniVersion": "1.0.0",`, fmt.Sprintf(`"cniVersion": "1.0.0", "writerVersion": %d,`, v), 1)
}

func versionedConf(v int64) string {
	return strings.Replace(bridgeConf, `"cniVersion": "0.4.0",`, fmt.Sprintf(`"cniVersion": "0.4.0", "writerVersion": %d,`, v), 1)
}

// writers are the two ways primary CNIs write their config: a temp file
// renamed over it (Cilium, renameio), and truncate + write in place
// (flannel's `cp -f`, os.WriteFile).
var writers = map[string]func(path, data string) error{
	"rename": func(path, data string) error {
		tmp := path + ".writer-tmp"
		if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
			return err
		}
		return os.Rename(tmp, path)
	},
	"in place": func(path, data string) error { return os.WriteFile(path, []byte(data), 0o644) },
}

// race runs write(v) for v = from, from+1, … in a tight loop and Install in
// another tight loop, both for at least d and until each made a few rounds;
// it returns the writer's last version once both stopped.
func race(t *testing.T, i *Installer, d time.Duration, from int64, write func(v int64) error) int64 {
	t.Helper()
	var last, passes atomic.Int64
	last.Store(from - 1)
	var stopW, stopI, failed atomic.Bool
	var wg sync.WaitGroup
	var werr, ierr error
	wg.Go(func() {
		for v := from; !stopW.Load(); v++ {
			if err := write(v); err != nil {
				werr = err
				failed.Store(true)
				return
			}
			last.Store(v)
		}
	})
	installerDone := make(chan struct{})
	go func() {
		defer close(installerDone)
		for !stopI.Load() {
			// A pass may run out of rounds against this writer
			// (errConflict) or find the file half written (no valid
			// config): both are retried, as Run does.
			if _, err := i.Install(); err != nil && !errors.Is(err, errConflict) && !errors.Is(err, ErrNoConfig) {
				ierr = err
				failed.Store(true)
				return
			}
			passes.Add(1)
		}
	}()
	time.Sleep(d)
	// On a busy machine either side may not have had its turn yet.
	deadline := time.Now().Add(10 * time.Second)
	for (last.Load() < from+2 || passes.Load() < 2) && time.Now().Before(deadline) && !failed.Load() {
		time.Sleep(time.Millisecond)
	}
	stopW.Store(true)
	wg.Wait()
	stopI.Store(true)
	<-installerDone
	if werr != nil || ierr != nil {
		t.Fatalf("writer: %v; installer: %v", werr, ierr)
	}
	if last.Load() < from+2 || passes.Load() < 2 {
		t.Fatalf("no race within 10s: %d installer passes, writer at version %d from %d", passes.Load(), last.Load(), from)
	}
	return last.Load()
}

// settlePasses runs Install until a pass succeeds (what Run does after the
// writer's last event).
func settlePasses(t *testing.T, i *Installer) {
	t.Helper()
	var err error
	for k := 0; k < 10; k++ {
		if _, err = i.Install(); err == nil {
			return
		}
	}
	t.Fatalf("Install after the writer stopped: %v", err)
}

// A primary CNI rewriting its conflist in a tight loop while the installer
// repairs: whenever the writer stops, its last write survives — with our
// entry put in (in-place mode) or copied into our own file (owned mode) —
// never our edit of one of its older writes.
func TestConcurrentPrimaryWritesSurvive(t *testing.T) {
	for _, inPlaceMode := range []bool{true, false} {
		for wname, write := range writers {
			name := "owned/" + wname
			if inPlaceMode {
				name = "in-place/" + wname
			}
			t.Run(name, func(t *testing.T) {
				h := newHostTree(t)
				primary := h.path("10-flannel.conflist")
				writeFile(t, primary, versioned(0), 0o644)
				i := h.installer(t, func(c *Config) { c.InPlace = inPlaceMode })
				if _, err := i.Install(); err != nil {
					t.Fatal(err)
				}
				for round := int64(0); round < 30; round++ {
					last := race(t, i, 20*time.Millisecond, round*1_000_000+1, func(v int64) error { return write(primary, versioned(v)) })
					settlePasses(t, i)
					got := readFile(t, primary)
					if inPlaceMode {
						want, err := i.entryOnly([]byte(versioned(last)))
						if err != nil {
							t.Fatal(err)
						}
						if got != string(want) {
							t.Fatalf("round %d: the writer's last write (version %d) did not survive; the primary holds:\n%s", round, last, got)
						}
					} else {
						if got != versioned(last) {
							t.Fatalf("round %d: owned mode changed the primary:\n%s", round, got)
						}
						if owned := readFile(t, h.path(DefaultOwnedName)); !strings.Contains(owned, fmt.Sprintf(`"writerVersion": %d,`, last)) {
							t.Fatalf("round %d: our copy does not follow the writer's last write (version %d):\n%s", round, last, owned)
						}
					}
					if err := i.Check(); err != nil {
						t.Fatalf("round %d: %v", round, err)
					}
				}
				// Nothing of ours left lying around (temp files, moved-aside files).
				entries, _ := os.ReadDir(h.conf)
				for _, e := range entries {
					if strings.HasPrefix(e.Name(), ".") {
						t.Errorf("left in the conf dir: %s", e.Name())
					}
				}
			})
		}
	}
}

// In-place mode turns a .conf into a .conflist and removes the .conf; a
// primary rewriting its .conf meanwhile must not have its fresh .conf
// deleted: whenever it stops, the runtime's config holds its last write.
func TestConvertKeepsAFreshConf(t *testing.T) {
	for wname, write := range writers {
		t.Run(wname, func(t *testing.T) {
			h := newHostTree(t)
			conf := h.path("10-mynet.conf")
			writeFile(t, conf, versionedConf(0), 0o644)
			i := h.installer(t, inPlace)
			var last int64
			for round := int64(0); round < 30; round++ {
				last = race(t, i, 20*time.Millisecond, round*1_000_000+1, func(v int64) error { return write(conf, versionedConf(v)) })
				settlePasses(t, i)
				name, chain := runtimeView(t, h.conf)
				if name != "10-mynet.conflist" || strings.Join(chain, ",") != "bridge,ambientd-cni" {
					t.Fatalf("round %d: runtime uses %s %v", round, name, chain)
				}
				if got := readFile(t, h.path(name)); !strings.Contains(got, strings.TrimSpace(versionedConf(last))) {
					t.Fatalf("round %d: the writer's last .conf (version %d) is lost; the runtime's config:\n%s", round, last, got)
				}
			}
			// Uninstall gives back the writer's last .conf, byte for byte.
			if err := i.Uninstall(); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, conf); got != versionedConf(last) || exists(h.path("10-mynet.conflist")) {
				t.Fatalf("after uninstall %s =\n%s\nwant the writer's last (version %d); conflist left: %v", conf, got, last, exists(h.path("10-mynet.conflist")))
			}
		})
	}
}

// The narrowest window: another writer gets in after our re-check, just
// before our swap. RENAME_EXCHANGE hands us what we replaced; the writer's
// text is carried forward, edited and swapped in again — for a writer that
// renames a new file in, one that rewrites the file in place, and one still
// in the middle of its write when we swap.
func TestSwapCarriesAWriteThatGotIn(t *testing.T) {
	cases := map[string]func(t *testing.T, path string, done *sync.WaitGroup){
		"rename": func(t *testing.T, path string, _ *sync.WaitGroup) {
			if err := writers["rename"](path, versioned(2)); err != nil {
				t.Error(err)
			}
		},
		"in place": func(t *testing.T, path string, _ *sync.WaitGroup) {
			if err := writers["in place"](path, versioned(2)); err != nil {
				t.Error(err)
			}
		},
		"in place, still writing": func(t *testing.T, path string, done *sync.WaitGroup) {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
			if err != nil {
				t.Error(err)
				return
			}
			text := versioned(2)
			if _, err := f.WriteString(text[:20]); err != nil {
				t.Error(err)
			}
			done.Go(func() { // the rest lands after our swap, in the file we took
				defer f.Close()
				time.Sleep(100 * time.Millisecond)
				if _, err := f.WriteString(text[20:]); err != nil {
					t.Error(err)
				}
			})
		},
	}
	for name, intrude := range cases {
		t.Run(name, func(t *testing.T) {
			h := newHostTree(t)
			path := h.path("10-flannel.conflist")
			writeFile(t, path, versioned(1), 0o644)
			i := h.installer(t, inPlace)
			first, err := readSnapshot(path)
			if err != nil {
				t.Fatal(err)
			}
			var done sync.WaitGroup
			intruded := 0
			e := fileEditor{beforeSwap: func(p string) {
				if intruded++; intruded == 1 {
					intrude(t, p, &done)
				}
			}}
			wrote, err := e.edit(path, first, i.entryOnly)
			done.Wait()
			if err != nil || !wrote {
				t.Fatalf("edit: wrote=%v %v", wrote, err)
			}
			if intruded < 2 {
				t.Fatalf("the intruding write was not noticed (%d swaps)", intruded)
			}
			want, _ := i.entryOnly([]byte(versioned(2)))
			if got := readFile(t, path); got != string(want) {
				t.Fatalf("after the swap the file holds\n%s\nwant the intruder's text with our entry\n%s", got, want)
			}
		})
	}
}
