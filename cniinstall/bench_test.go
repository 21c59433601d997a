package cniinstall

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
)

// benchInstaller is an installed host tree in the given mode, with a plugin
// binary of realistic size (the real one is ~20 MB), as a pass finds it when
// nothing changed.
func benchInstaller(b *testing.B, inPlace bool) *Installer {
	b.Helper()
	root := b.TempDir()
	h := hostTree{root: root, bin: filepath.Join(root, "opt/cni/bin"), conf: filepath.Join(root, "etc/cni/net.d"), src: filepath.Join(root, "image/ambientd-cni")}
	for _, d := range []string{h.bin, h.conf, filepath.Dir(h.src)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	if err := os.WriteFile(h.src, make([]byte, 20<<20), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(h.conf, "10-flannel.conflist"), []byte(flannelConflist), 0o644); err != nil {
		b.Fatal(err)
	}
	cfg := h.config()
	cfg.InPlace = inPlace
	i, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := i.Install(); err != nil {
		b.Fatal(err)
	}
	return i
}

// BenchmarkPassNothingToDo is one installer pass over an installed node —
// the cost of every resync, every event burst and every poll while inotify
// is unavailable.
func BenchmarkPassNothingToDo(b *testing.B) {
	for _, inPlace := range []bool{false, true} {
		name := "owned"
		if inPlace {
			name = "in-place"
		}
		b.Run(name, func(b *testing.B) {
			i := benchInstaller(b, inPlace)
			b.ReportAllocs()
			for b.Loop() {
				if changed, err := i.Install(); err != nil || changed {
					b.Fatalf("changed=%v %v", changed, err)
				}
			}
		})
	}
}

// BenchmarkCheck is readiness's question (every /readyz, node-condition
// evaluation and metrics scrape).
func BenchmarkCheck(b *testing.B) {
	i := benchInstaller(b, false)
	b.ReportAllocs()
	for b.Loop() {
		if err := i.Check(); err != nil {
			b.Fatal(err)
		}
	}
}
