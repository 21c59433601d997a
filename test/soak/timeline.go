package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// timeline is what the timeline picture shows, written as timeline.json
// beside summary.txt. The picture itself is drawn by test/soakplot, a
// test-only module of its own, so that no plotting library enters the
// product module's go.mod; `make soak` runs it on this file. The JSON is
// the contract between the two: test/soakplot's timeline type reads it.
type timeline struct {
	Title string `json:"title"`
	// Series are the lines above zero: pods by sampled state per round.
	Series []timelineSeries `json:"series"`
	// FaultKinds name the rows below zero, top to bottom.
	FaultKinds []string        `json:"faultKinds"`
	Faults     []timelineFault `json:"faults"`
	// Violations are the times (seconds since the start) of the violations.
	Violations []float64 `json:"violations"`
}

// timelineSeries is one line: Y[i] pods at X[i] seconds since the start.
type timelineSeries struct {
	Name string    `json:"name"`
	X    []float64 `json:"x"`
	Y    []float64 `json:"y"`
}

// timelineFault is one fault, a bar in its kind's row (seconds since the
// start).
type timelineFault struct {
	Kind  string  `json:"kind"`
	Start float64 `json:"start"`
	End   float64 `json:"end"`
}

// timeline gathers the pods by sampled state over time (and those bypassing
// while claimed enrolled), each fault (one still in flight ends at now) and
// each violation.
func (r *result) timeline(now time.Time) timeline {
	rec := r.rec
	rec.mu.Lock()
	defer rec.mu.Unlock()
	tl := timeline{
		Title:      fmt.Sprintf("soak, seed %d: pods by sampled state; faults below", r.cfg.seed),
		FaultKinds: allFaultKinds(),
		Faults:     []timelineFault{},
		Violations: []float64{},
	}
	for _, s := range []struct {
		name string
		get  func(round) int
	}{
		{stMeshed.String(), func(x round) int { return x.Counts[stMeshed] }},
		{stPlain.String(), func(x round) int { return x.Counts[stPlain] }},
		{stBlackHole.String(), func(x round) int { return x.Counts[stBlackHole] }},
		{stPartial.String() + " / foreign", func(x round) int { return x.Counts[stPartial] + x.Counts[stForeign] }},
		{"sidecar (own proxy)", func(x round) int { return x.Counts[stSidecar] }},
		{"claimed enrolled, traffic direct", func(x round) int { return x.Bypassing }},
	} {
		line := timelineSeries{Name: s.name, X: make([]float64, len(rec.rounds)), Y: make([]float64, len(rec.rounds))}
		for k, x := range rec.rounds {
			line.X[k], line.Y[k] = x.At.Seconds(), float64(s.get(x))
		}
		tl.Series = append(tl.Series, line)
	}
	for _, f := range rec.faults {
		end := f.End
		if !f.done {
			end = now
		}
		tl.Faults = append(tl.Faults, timelineFault{Kind: f.Kind, Start: f.Start.Sub(rec.start).Seconds(), End: end.Sub(rec.start).Seconds()})
	}
	for _, v := range r.violations {
		tl.Violations = append(tl.Violations, v.At.Sub(rec.start).Seconds())
	}
	return tl
}

// write puts summary.txt and timeline.json in dir.
func (r *result) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "summary.txt"), []byte(r.summary()+r.lastLine()+"\n"), 0o644); err != nil {
		return err
	}
	b, err := json.Marshal(r.timeline(time.Now()))
	if err != nil {
		return fmt.Errorf("timeline: %w", err)
	}
	path := filepath.Join(dir, "timeline.json")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "soak: timeline data in %s (drawn by test/soakplot)\n", path)
	return nil
}
