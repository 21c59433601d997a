package cniinstall

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const ciliumConflist = `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni","enable-debug":false}]}`

// ciliumTakesOver does what Cilium's agent does at start: writes its
// conflist and, with cni-exclusive=true, renames every other .conf,
// .conflist and .json to NAME.cilium_bak (daemon/cmd/cni/config.go).
func ciliumTakesOver(t *testing.T, dir string, exclusive bool) {
	t.Helper()
	writeFile(t, filepath.Join(dir, "05-cilium.conflist"), ciliumConflist, 0o644)
	if !exclusive {
		return
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		n := e.Name()
		if n == "05-cilium.conflist" || e.IsDir() || !(strings.HasSuffix(n, ".conf") || strings.HasSuffix(n, ".conflist") || strings.HasSuffix(n, ".json")) {
			continue
		}
		if err := os.Rename(filepath.Join(dir, n), filepath.Join(dir, n+".cilium_bak")); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCheckNamesExclusiveCNI: when Cilium's cni-exclusive renames our
// config (and the primary's) away, the installer's check — the node
// condition's — says so (ErrExclusiveCNI, naming the renamed files);
// a backup left from before the agent started, or Cilium without
// exclusive mode, is not taken for it.
func TestCheckNamesExclusiveCNI(t *testing.T) {
	for _, exclusive := range []bool{true, false} {
		t.Run(map[bool]string{true: "exclusive", false: "not exclusive"}[exclusive], func(t *testing.T) {
			h := newHostTree(t)
			// A leftover of an earlier exclusive Cilium, before this agent.
			writeFile(t, h.path("10-old.conflist.cilium_bak"), flannelConflist, 0o644)
			writeFile(t, h.path("10-calico.conflist"), flannelConflist, 0o644)
			i := h.installer(t)
			if _, err := i.Install(); err != nil {
				t.Fatal(err)
			}
			if err := i.Check(); err != nil {
				t.Fatalf("installed: %v", err)
			}
			ciliumTakesOver(t, h.conf, exclusive)
			if !exclusive {
				// Our owned file sorts first and survives; remove it as
				// another component might, to get a failing check.
				if err := os.Remove(h.path(DefaultOwnedName)); err != nil {
					t.Fatal(err)
				}
			}
			err := i.Check()
			if err == nil {
				t.Fatal("Check passes with our config gone")
			}
			if got := errors.Is(err, ErrExclusiveCNI); got != exclusive {
				t.Fatalf("Check = %v; ErrExclusiveCNI %v, want %v", err, got, exclusive)
			}
			if !exclusive {
				return
			}
			msg := err.Error()
			for _, want := range []string{DefaultOwnedName + ", 10-calico.conflist renamed to *.cilium_bak", "cni.exclusive=false", "runtime's config"} {
				if !strings.Contains(msg, want) {
					t.Errorf("Check = %q; want it to say %q", msg, want)
				}
			}
			if strings.Contains(msg, "10-old.conflist") {
				t.Errorf("Check = %q names a backup older than the agent", msg)
			}
		})
	}
}
