package main

import (
	"bytes"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// BenchmarkPluginAdd measures what the runtime waits for per pod on our
// account: exec of ambientd-cni to its exit, for an ADD answered at once by
// the agent (target: median under 10 ms). It reports wall-clock median and
// p99, and the median CPU time of the plugin process, which a loaded machine
// inflates far less than wall time. The sibling benchmarks put the numbers in
// context: the same binary doing only VERSION (process start plus Go and
// package init, no agent call), a reference plugin's VERSION, and /bin/true
// (the machine's bare exec cost).
func BenchmarkPluginAdd(b *testing.B) {
	podNS := newNS(b)
	ag := &fakeAgent{outcome: agent.Enrolled}
	sock := startAgent(b, ag)
	stdin := netconf("1.1.0", fmt.Sprintf(`,"agentSocket":%q`, sock), prevResult(podNS.Path()))
	env := cniEnv("ADD", podNS.Path(), podArgs)
	runs := benchExec(b, func() run { return execPlugin(b, env, stdin, nil) })
	if adds, _ := ag.events(); len(adds) < runs {
		b.Fatalf("agent saw %d adds for %d execs", len(adds), runs)
	}
}

func BenchmarkPluginVersion(b *testing.B) {
	benchExec(b, func() run { return execPlugin(b, map[string]string{"CNI_COMMAND": "VERSION"}, nil, nil) })
}

// BenchmarkLoopbackVersion: the startup of a reference CNI plugin (loopback
// from containernetworking/plugins), for scale.
func BenchmarkLoopbackVersion(b *testing.B) {
	bin := filepath.Join(binDir, "loopback")
	benchExec(b, func() run { return execBinary(b, bin, map[string]string{"CNI_COMMAND": "VERSION"}, nil, nil) })
}

func BenchmarkExecTrue(b *testing.B) {
	bin, err := exec.LookPath("true")
	if err != nil {
		b.Fatalf("need true(1): %v", err)
	}
	benchExec(b, func() run { return execBinary(b, bin, nil, nil, nil) })
}

// benchExec runs one exec per iteration, fails on a non-zero exit, and
// reports median-ms, p99-ms and cpu-median-ms. It returns the number of runs.
func benchExec(b *testing.B, one func() run) int {
	var took, cpu []time.Duration
	for b.Loop() {
		r := one()
		if r.exit != 0 {
			b.Fatalf("exit %d: %s %s", r.exit, r.stdout, r.stderr)
		}
		took = append(took, r.took)
		cpu = append(cpu, r.cpu)
	}
	slices.Sort(took)
	slices.Sort(cpu)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(took[len(took)/2]), "median-ms")
	b.ReportMetric(ms(took[min(len(took)-1, len(took)*99/100)]), "p99-ms")
	b.ReportMetric(ms(cpu[len(cpu)/2]), "cpu-median-ms")
	return len(took)
}

// BenchmarkPluginAddInstructions counts the instructions one ADD of
// ambientd-cni executes (exec to exit, the agent answering at once), under
// valgrind's callgrind: a CPU-work measure for before/after comparisons
// that a loaded machine does not blur as it blurs wall and CPU time. Go's
// asynchronous preemption is off for the run (callgrind cannot follow its
// signals); everything else is the shipped binary as it runs.
func BenchmarkPluginAddInstructions(b *testing.B) {
	vg := testutil.RequireBinary(b, "valgrind")[0] // hack/deps.sh installs it
	podNS := newNS(b)
	sock := startAgent(b, &fakeAgent{outcome: agent.Enrolled})
	stdin := netconf("1.1.0", fmt.Sprintf(`,"agentSocket":%q`, sock), prevResult(podNS.Path()))
	env := cniEnv("ADD", podNS.Path(), podArgs)
	var counts []float64
	for b.Loop() {
		out := filepath.Join(b.TempDir(), "callgrind.out")
		cmd := exec.CommandContext(b.Context(), vg, "--tool=callgrind", "--callgrind-out-file="+out, filepath.Join(binDir, "ambientd-cni"))
		cmd.Env = []string{"CNI_PATH=" + binDir, "GODEBUG=asyncpreemptoff=1"}
		for k, v := range env {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		cmd.Stdin = bytes.NewReader(stdin)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			b.Fatalf("valgrind ambientd-cni ADD: %v\n%s", err, stderr.String())
		}
		_, rest, ok := strings.Cut(stderr.String(), "Collected : ")
		if !ok {
			b.Fatalf("no instruction count in callgrind's output:\n%s", stderr.String())
		}
		n, err := strconv.ParseFloat(strings.Fields(rest)[0], 64)
		if err != nil {
			b.Fatalf("instruction count %q: %v", rest, err)
		}
		counts = append(counts, n)
	}
	slices.Sort(counts)
	b.ReportMetric(counts[len(counts)/2], "instructions/op")
}
