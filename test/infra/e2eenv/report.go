package e2eenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Metric reads one sample of the agent's /metrics: name with the exact
// label text (e.g. `phase="enabled"`), or "" for an unlabelled metric. An
// absent sample reads 0.
func (a *Agent) Metric(ctx context.Context, name, labels string) (float64, error) {
	body, err := a.Metrics(ctx)
	if err != nil {
		return 0, err
	}
	prefix := name
	if labels != "" {
		prefix += "{" + labels + "}"
	}
	for _, l := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(l, prefix+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				return 0, fmt.Errorf("metric %s: %w", prefix, err)
			}
			return v, nil
		}
	}
	return 0, nil
}

// Percentile is the p-th (0..1) value of d by nearest rank (0 when empty).
func Percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[int(float64(len(s)-1)*p+0.5)]
}

// Machine describes this machine for a report of numbers: CPUs and model,
// memory, kernel, Go version and the load average now (the machine is
// shared: numbers are read against it).
func Machine() string {
	mem := "?"
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(l, "MemTotal:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
				mem = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
			}
		}
	}
	kernel, _ := exec.Command("uname", "-r").Output()
	model := "?"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(l, "model name"); ok {
				model = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(rest), ":"))
				break
			}
		}
	}
	return fmt.Sprintf("%d CPUs (%s), %s RAM, kernel %s, %s; load average %s",
		runtime.NumCPU(), model, mem, strings.TrimSpace(string(kernel)), runtime.Version(), LoadAverage())
}

// LoadAverage is the 1, 5 and 15 minute load averages ("?" if unreadable).
func LoadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "?"
}
