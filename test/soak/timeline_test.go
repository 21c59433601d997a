package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// TestTimeline: the timeline file holds each round's pods by state (partial
// and foreign proxy counted together), the bypassing pods, each fault in
// its kind's row as seconds since the start (one still in flight ends at
// the time the file is written) and each violation's time — what
// test/soakplot draws.
func TestTimeline(t *testing.T) {
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	var c1, c2 [numStates]int
	c1[stMeshed], c1[stPlain] = 10, 4
	c2[stMeshed], c2[stPartial], c2[stForeign], c2[stSidecar] = 8, 1, 2, 3
	rec := &recorder{
		start:  start,
		rounds: []round{{At: 500 * time.Millisecond, Counts: c1}, {At: 2 * time.Second, Counts: c2, Bypassing: 1}},
		faults: []faultRec{
			{Kind: "agent-kill", Start: start.Add(time.Second), End: start.Add(3 * time.Second), done: true},
			{Kind: "agent-kill", Start: start.Add(4 * time.Second)}, // in flight
		},
	}
	r := &result{cfg: config{seed: 7}, rec: rec, violations: []violation{{At: start.Add(1500 * time.Millisecond), Kind: kindBypass}}}
	dir := t.TempDir()
	if err := r.write(dir); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "timeline.json"))
	if err != nil {
		t.Fatal(err)
	}
	var tl timeline
	if err := json.Unmarshal(b, &tl); err != nil {
		t.Fatal(err)
	}
	if tl.Title != "soak, seed 7: pods by sampled state; faults below" {
		t.Errorf("title %q", tl.Title)
	}
	want := map[string][]float64{
		"meshed":                           {10, 8},
		"plain":                            {4, 0},
		"black hole":                       {0, 0},
		"partial / foreign":                {0, 3},
		"sidecar (own proxy)":              {0, 3},
		"claimed enrolled, traffic direct": {0, 1},
	}
	if len(tl.Series) != len(want) {
		t.Errorf("%d series, want %d: %+v", len(tl.Series), len(want), tl.Series)
	}
	for _, s := range tl.Series {
		if !slices.Equal(s.X, []float64{0.5, 2}) || !slices.Equal(s.Y, want[s.Name]) {
			t.Errorf("series %q: x %v y %v, want x [0.5 2] y %v", s.Name, s.X, s.Y, want[s.Name])
		}
	}
	if !slices.Equal(tl.FaultKinds, allFaultKinds()) {
		t.Errorf("fault kinds %v, want %v", tl.FaultKinds, allFaultKinds())
	}
	if len(tl.Faults) != 2 || tl.Faults[0] != (timelineFault{Kind: "agent-kill", Start: 1, End: 3}) ||
		tl.Faults[1].Start != 4 || tl.Faults[1].End < 4 {
		t.Errorf("faults %+v: want [1 s, 3 s] and one in flight from 4 s to when the file was written", tl.Faults)
	}
	if !slices.Equal(tl.Violations, []float64{1.5}) {
		t.Errorf("violations %v, want [1.5]", tl.Violations)
	}
	if _, err := os.Stat(filepath.Join(dir, "summary.txt")); err != nil {
		t.Errorf("summary: %v", err)
	}
}
