// Command soakplot draws the soak's timeline (test/soak, docs/soak.md): for
// each directory given, it reads the timeline.json the soak wrote there and
// writes timeline.png and timeline.svg beside it — pods by sampled state
// over time, each fault as a bar in its kind's row below zero and each
// violation as a cross. `make soak` runs it on the soak's output and
// `make soak-check` on its tests' output.
//
// It is a test-only module of its own (like test/helm) so that gonum/plot
// stays out of the product module's go.mod; it imports nothing from the
// product: the JSON is the contract (test/soak/timeline.go writes it).
//
//	cd test/soakplot && go run . ../../.cache/soak
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// timeline is test/soak's timeline.json.
type timeline struct {
	Title  string `json:"title"`
	Series []struct {
		Name string    `json:"name"`
		X    []float64 `json:"x"`
		Y    []float64 `json:"y"`
	} `json:"series"`
	FaultKinds []string `json:"faultKinds"`
	Faults     []struct {
		Kind  string  `json:"kind"`
		Start float64 `json:"start"`
		End   float64 `json:"end"`
	} `json:"faults"`
	Violations []float64 `json:"violations"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: soakplot DIR... (each holding the soak's timeline.json)")
		os.Exit(2)
	}
	for _, dir := range os.Args[1:] {
		if err := draw(dir); err != nil {
			fmt.Fprintln(os.Stderr, "soakplot:", err)
			os.Exit(1)
		}
	}
}

// draw reads dir/timeline.json and writes dir/timeline.png and .svg.
func draw(dir string) error {
	in := filepath.Join(dir, "timeline.json")
	b, err := os.ReadFile(in)
	if err != nil {
		return err
	}
	var tl timeline
	if err := json.Unmarshal(b, &tl); err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	p, err := tl.plot()
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	for _, ext := range []string{"png", "svg"} {
		path := filepath.Join(dir, "timeline."+ext)
		if err := p.Save(14*vg.Inch, 7*vg.Inch, path); err != nil {
			return fmt.Errorf("plot %s: %w", path, err)
		}
		fmt.Fprintf(os.Stderr, "soak: timeline in %s\n", path)
	}
	return nil
}

// plot draws the series as lines, each fault as a bar in its kind's row
// below zero and each violation as a cross on the zero line.
func (tl timeline) plot() (*plot.Plot, error) {
	if len(tl.Series) == 0 {
		return nil, fmt.Errorf("no series to draw")
	}
	p := plot.New()
	p.Title.Text = tl.Title
	p.X.Label.Text = "seconds since the start"
	p.Y.Label.Text = "pods"
	p.Legend.Top = true
	for i, s := range tl.Series {
		if len(s.X) != len(s.Y) {
			return nil, fmt.Errorf("series %q: %d times, %d values", s.Name, len(s.X), len(s.Y))
		}
		xy := make(plotter.XYs, len(s.X))
		for k := range s.X {
			xy[k].X, xy[k].Y = s.X[k], s.Y[k]
		}
		l, err := plotter.NewLine(xy)
		if err != nil {
			return nil, err
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(1.2)
		p.Add(l)
		p.Legend.Add(s.Name, l)
	}
	row := func(kind string) int { return slices.Index(tl.FaultKinds, kind) }
	for _, f := range tl.Faults {
		r := row(f.Kind)
		if r < 0 {
			return nil, fmt.Errorf("fault kind %q not among faultKinds %v", f.Kind, tl.FaultKinds)
		}
		y := -2 * float64(r+1)
		l, err := plotter.NewLine(plotter.XYs{{X: f.Start, Y: y}, {X: f.End, Y: y}})
		if err != nil {
			return nil, err
		}
		l.Color = plotutil.Color(5 + r)
		l.Width = vg.Points(6)
		p.Add(l)
	}
	if len(tl.Violations) > 0 {
		xy := make(plotter.XYs, len(tl.Violations))
		for i, at := range tl.Violations {
			xy[i].X = at
		}
		sc, err := plotter.NewScatter(xy)
		if err != nil {
			return nil, err
		}
		sc.GlyphStyle.Shape = plotutil.Shape(3)
		sc.GlyphStyle.Radius = vg.Points(5)
		p.Add(sc)
		p.Legend.Add("violation", sc)
	}
	p.Y.Tick.Marker = faultRowTicks{kinds: tl.FaultKinds}
	p.Y.Min = -2*float64(len(tl.FaultKinds)) - 1
	p.Add(plotter.NewGrid())
	return p, nil
}

// faultRowTicks labels the rows below zero with the fault kinds and the
// range above with pod counts.
type faultRowTicks struct{ kinds []string }

func (t faultRowTicks) Ticks(lo, hi float64) []plot.Tick {
	var out []plot.Tick
	for i, k := range t.kinds {
		out = append(out, plot.Tick{Value: -2 * float64(i+1), Label: k})
	}
	for _, tk := range (plot.DefaultTicks{}).Ticks(0, hi) {
		if tk.Value >= 0 {
			out = append(out, tk)
		}
	}
	return out
}
