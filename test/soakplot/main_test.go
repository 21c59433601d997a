package main

import (
	"bytes"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDraw: a timeline file as the soak writes it (testdata/timeline.json)
// becomes a 14×7-inch PNG and an SVG that carry its title and fault rows.
func TestDraw(t *testing.T) {
	dir := t.TempDir()
	b, err := os.ReadFile("testdata/timeline.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "timeline.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := draw(dir); err != nil {
		t.Fatal(err)
	}
	pngBytes, err := os.ReadFile(filepath.Join(dir, "timeline.png"))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := png.DecodeConfig(bytes.NewReader(pngBytes))
	if err != nil {
		t.Fatalf("timeline.png: %v", err)
	}
	if cfg.Width != 2*cfg.Height || cfg.Width < 1000 {
		t.Errorf("timeline.png is %d×%d, want 14×7 inches", cfg.Width, cfg.Height)
	}
	svg, err := os.ReadFile(filepath.Join(dir, "timeline.svg"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"soak, seed 1: pods by sampled state; faults below", "ztunnel-kill", "claimed enrolled, traffic direct", "violation"} {
		if !strings.Contains(string(svg), want) {
			t.Errorf("timeline.svg lacks %q", want)
		}
	}
}

// TestDrawRejects: a missing or malformed file, or one whose parts do not
// fit together, is an error naming the file, and nothing is drawn.
func TestDrawRejects(t *testing.T) {
	for _, c := range []struct{ name, json, want string }{
		{"no file", "", "timeline.json"},
		{"not JSON", "{", "timeline.json"},
		{"no series", `{"title":"x","faultKinds":[]}`, "no series"},
		{"times and values apart", `{"series":[{"name":"meshed","x":[1,2],"y":[3]}]}`, `series "meshed": 2 times, 1 values`},
		{"a fault of no row", `{"series":[{"name":"meshed","x":[1],"y":[3]}],"faultKinds":["agent-kill"],"faults":[{"kind":"other","start":1,"end":2}]}`, `fault kind "other"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if c.json != "" {
				if err := os.WriteFile(filepath.Join(dir, "timeline.json"), []byte(c.json), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			err := draw(dir)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("draw: %v, want an error with %q", err, c.want)
			}
			if _, err := os.Stat(filepath.Join(dir, "timeline.png")); !os.IsNotExist(err) {
				t.Errorf("timeline.png drawn from a bad file (%v)", err)
			}
		})
	}
}
