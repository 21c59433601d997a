// Command bench is the enrollment benchmark (`make bench-e2e`): on the real
// control plane (kube-apiserver + etcd), the libcni chain and the ztunnel
// emulator in netns mode, it creates N pods in bursts twice — first through
// the chain without our plugin (the baseline), then through the chain with
// it in an ambient namespace — and prints one Markdown table: CNI ADD
// latency through the chain and the part our plugin + agent add, time until
// every pod is enabled, the agent's CPU and peak RSS, restart → snapshot
// acked with all N enrolled, one rule verification pass, and the removal of
// all N. It measures; it asserts nothing but that every step finished.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// config is the benchmark's settings; each flag has an environment variable.
type config struct {
	pods, burst, verifyWorkers int
	out                        string
	timeout                    time.Duration
	agentArgs                  string
	// scenario is "enrollment" (the default) or "ztunnel-outage"
	// (outage.go), repeated outages times.
	scenario string
	outages  int
	// interleave alternates the baseline and ours burst by burst (each
	// baseline burst deleted before the next burst of ours), so both see
	// the same machine load; off: the whole baseline first.
	interleave bool
	// profileDir, when set, receives the agent's CPU profile over the
	// ambient pods' creation and its allocation profile after it (the
	// agent runs with --pprof-addr).
	profileDir     string
	profileSeconds int
	pprofAddr      string // the agent's --pprof-addr, set by run
	first          int    // createPods: index of the first pod
}

func main() {
	var c config
	flag.IntVar(&c.pods, "pods", e2eenv.EnvInt("BENCH_PODS", 100), "pods to create (env BENCH_PODS)")
	flag.IntVar(&c.burst, "burst", e2eenv.EnvInt("BENCH_BURST", 50), "pods created at once in each burst (env BENCH_BURST)")
	flag.IntVar(&c.verifyWorkers, "verify-workers", e2eenv.EnvInt("BENCH_VERIFY_WORKERS", 4), "pods verified at once in the verification pass (env BENCH_VERIFY_WORKERS)")
	flag.StringVar(&c.out, "out", os.Getenv("BENCH_OUT"), "also append the result table to this file (env BENCH_OUT)")
	flag.DurationVar(&c.timeout, "timeout", e2eenv.EnvDuration("BENCH_TIMEOUT", 30*time.Minute), "give up after this long (env BENCH_TIMEOUT)")
	flag.StringVar(&c.agentArgs, "agent-args", os.Getenv("BENCH_AGENT_ARGS"), "extra flags for `ambientd run`, space separated (env BENCH_AGENT_ARGS)")
	flag.StringVar(&c.scenario, "scenario", e2eenv.EnvString("BENCH_SCENARIO", "enrollment"), "enrollment, or ztunnel-outage: N enrolled pods, the only ztunnel killed, a new one once all are False (env BENCH_SCENARIO)")
	flag.IntVar(&c.outages, "outages", e2eenv.EnvInt("BENCH_OUTAGES", 2), "outages of the ztunnel-outage scenario (env BENCH_OUTAGES)")
	flag.BoolVar(&c.interleave, "interleave", e2eenv.EnvBool("BENCH_INTERLEAVE"), "alternate baseline and ambient bursts in one run instead of the whole baseline first (env BENCH_INTERLEAVE)")
	flag.StringVar(&c.profileDir, "profile", os.Getenv("BENCH_PROFILE"), "write the agent's CPU profile of the ambient creation and its allocation profile to this directory (env BENCH_PROFILE)")
	flag.IntVar(&c.profileSeconds, "profile-seconds", e2eenv.EnvInt("BENCH_PROFILE_SECONDS", 30), "length of the CPU profile from the first ambient pod on (env BENCH_PROFILE_SECONDS)")
	flag.Parse()
	if c.pods < 1 || c.pods > 4000 || c.burst < 1 || c.verifyWorkers < 1 || c.outages < 1 || (c.scenario != "enrollment" && c.scenario != "ztunnel-outage") {
		fmt.Fprintln(os.Stderr, "bench: -pods must be 1..4000, -burst, -verify-workers and -outages positive, -scenario enrollment or ztunnel-outage")
		os.Exit(2)
	}
	// A /20 holds 4094 pods: host-local never runs out, whatever N.
	opts := e2eenv.Options{NodeName: "bench-node", AmbientPlugin: true, Subnet: netip.MustParsePrefix("10.88.0.0/20")}
	os.Exit(e2eenv.Program(opts, func(ctx context.Context, env *e2eenv.Env) int {
		ctx, cancel := context.WithTimeout(ctx, c.timeout)
		defer cancel()
		var res interface{ markdown() string }
		var err error
		if c.scenario == "ztunnel-outage" {
			res, err = runOutage(ctx, env, c)
		} else {
			res, err = run(ctx, env, c)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench: %v\n", err)
			return 1
		}
		table := res.markdown()
		fmt.Print(table)
		if c.out != "" {
			f, err := os.OpenFile(c.out, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
			if err == nil {
				_, err = io.WriteString(f, table)
				err = errors.Join(err, f.Close())
			}
			if err != nil {
				fmt.Fprintf(os.Stderr, "bench: write %s: %v\n", c.out, err)
				return 1
			}
		}
		return 0
	}))
}

// result holds every number the table shows.
type result struct {
	cfg                         config
	machine, mode               string
	agentBackend                string // the agent's own choice, from its log
	plainAdd, meshAdd           []time.Duration
	addErrors                   int
	createWall, allEnabledAgent time.Duration
	allAnnotated                time.Duration
	agentAddMean                time.Duration
	cpu1, cpu2                  time.Duration
	rss0, rss1, rss2            int64 // KiB
	restartAck, restartEnabled  time.Duration
	snapshotAdds                int
	verify                      time.Duration
	verifyDrift                 int
	removal                     time.Duration
	steps                       map[string]time.Duration // mean per enrollment step
	execOurs, execBridge        time.Duration            // p50 of a plugin's VERSION exec
	pluginCall                  []time.Duration          // the plugin's agent call, from its log
	// Each plugin process's ADD (exec to exit, as libcni ran it): p for
	// the plain chain, m for the chain with our plugin.
	execLoP, execLoM, execBrP, execBrM, execOursAdd []time.Duration
	rssAnon0, rssFile0, rssAnon1, rssFile1          int64   // KiB, ready with 0 pods / N enrolled
	heap0, heap1                                    float64 // go_memstats_heap_inuse_bytes: 0 pods, N enrolled
	runtime1                                        string  // the Go runtime's other memory and goroutines, N enrolled
	// addSteps is ambientd_cni_add_step_duration_seconds by step over the
	// ambient pods' ADDs; plugin the plugin's own breakdown from its log.
	addSteps map[string]histogram
	plugin   map[string][]time.Duration
	cpuPods  time.Duration // agent CPU per ambient pod (create + enable)
}

// pluginLog reads our plugin's per-ADD breakdown for pods of namespace
// from its log ("agent answered": init, config, took = the agent call,
// agent = the agent's part of it, reply, total), by key.
func pluginLog(logFile, namespace string) map[string][]time.Duration {
	b, err := os.ReadFile(logFile)
	if err != nil {
		return nil
	}
	out := map[string][]time.Duration{}
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.Contains(l, `msg="agent answered"`) || !strings.Contains(l, " namespace="+namespace+" ") {
			continue
		}
		for _, k := range pluginKeys {
			_, v, ok := strings.Cut(l, " "+k+"=")
			if !ok {
				continue
			}
			if d, err := time.ParseDuration(strings.Fields(v)[0]); err == nil {
				out[k] = append(out[k], d)
			}
		}
	}
	return out
}

// pluginKeys are the duration keys of the plugin's "agent answered" line.
var pluginKeys = []string{"init", "config", "took", "agent", "reply", "total"}

// addStepNames are the steps of ambientd_cni_add_step_duration_seconds.
var addStepNames = []string{"plugin_init", "plugin_config", "dial", "check", "netns", "lookup", "queue", "rules", "ztunnel_ack", "probe_ips", "agent"}

// histogram is one series of a Prometheus histogram: cumulative bucket
// counts by upper bound, count and sum.
type histogram struct {
	le     []float64
	counts []float64
	count  float64
	sum    float64
}

func (h histogram) mean() time.Duration {
	if h.count == 0 {
		return 0
	}
	return time.Duration(h.sum / h.count * float64(time.Second))
}

// quantile estimates the q-quantile as Prometheus' histogram_quantile does
// (linear within the bucket).
func (h histogram) quantile(q float64) time.Duration {
	if h.count == 0 {
		return 0
	}
	rank := q * h.count
	lower, prev := 0.0, 0.0
	for i, le := range h.le {
		if h.counts[i] >= rank {
			if math.IsInf(le, 1) {
				return time.Duration(lower * float64(time.Second))
			}
			frac := (rank - prev) / max(h.counts[i]-prev, 1e-9)
			return time.Duration((lower + (le-lower)*frac) * float64(time.Second))
		}
		lower, prev = le, h.counts[i]
	}
	return time.Duration(lower * float64(time.Second))
}

// histograms reads every series of histogram name from the agent's
// /metrics, keyed by the value of label.
func histograms(ctx context.Context, a *e2eenv.Agent, name, label string) map[string]histogram {
	body, err := a.Metrics(ctx)
	if err != nil {
		return nil
	}
	out := map[string]histogram{}
	for _, l := range strings.Split(body, "\n") {
		if !strings.HasPrefix(l, name+"_") {
			continue
		}
		key := labelValue(l, label)
		h := out[key]
		sp := strings.LastIndexByte(l, ' ')
		v, _ := strconv.ParseFloat(l[sp+1:], 64)
		switch {
		case strings.HasPrefix(l, name+"_bucket{"):
			le, _ := strconv.ParseFloat(labelValue(l, "le"), 64)
			h.le, h.counts = append(h.le, le), append(h.counts, v)
		case strings.HasPrefix(l, name+"_sum{"):
			h.sum = v
		case strings.HasPrefix(l, name+"_count{"):
			h.count = v
		}
		out[key] = h
	}
	return out
}

// labelValue is the value of label in one exposition line ("" if absent).
func labelValue(line, label string) string {
	_, rest, ok := strings.Cut(line, label+`="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// enrollment steps of ambientd_enrollment_step_duration_seconds, in order.
var stepNames = []string{"lookup", "netns", "rules", "ztunnel_ack", "probe_ips", "status_write"}

// execCost is the p50 of 20 runs of a CNI plugin's VERSION command: what
// exec'ing the binary alone costs on this machine now.
func execCost(ctx context.Context, bin string) time.Duration {
	var d []time.Duration
	for range 20 {
		cmd := exec.CommandContext(ctx, bin)
		cmd.Env = []string{"CNI_COMMAND=VERSION"}
		cmd.Stdin = strings.NewReader(`{"cniVersion":"1.0.0"}`)
		start := time.Now()
		if err := cmd.Run(); err != nil {
			return 0
		}
		d = append(d, time.Since(start))
	}
	return pct(d, .5)
}

// startNode starts the ztunnel emulator (netns mode) and the agent with the
// benchmark's extra flags, and waits until the agent is ready.
func startNode(ctx context.Context, env *e2eenv.Env, c config) (*e2eenv.Emulator, *e2eenv.Agent, error) {
	em, err := env.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: "ztunnel"})
	if err != nil {
		return nil, nil, err
	}
	// The product's default backend choice (--iptables=auto), not the e2e
	// environment's iptables-nft pin; -agent-args may still set one.
	args := append([]string{"--iptables=auto"}, strings.Fields(c.agentArgs)...)
	if c.pprofAddr != "" {
		args = append(args, "--pprof-addr="+c.pprofAddr)
	}
	a, err := env.StartAgent(ctx, e2eenv.AgentConfig{Args: args})
	if err != nil {
		return nil, nil, err
	}
	if err := a.WaitReady(ctx); err != nil {
		return nil, nil, fmt.Errorf("agent not ready: %w\n%s", err, a.LogTail(20))
	}
	return em, a, nil
}

func run(ctx context.Context, env *e2eenv.Env, c config) (*result, error) {
	r := &result{cfg: c, machine: e2eenv.Machine()}
	if c.profileDir != "" {
		addr, err := freeAddr()
		if err != nil {
			return nil, err
		}
		c.pprofAddr = addr
		if err := os.MkdirAll(c.profileDir, 0o755); err != nil {
			return nil, err
		}
	}
	em, a, err := startNode(ctx, env, c)
	if err != nil {
		return nil, err
	}
	r.rss0 = peakRSS(a.Pid())
	r.agentBackend = agentBackend(env.LogPath("agent"))
	r.rssAnon0, r.rssFile0 = statusKiB(a.Pid(), "RssAnon:"), statusKiB(a.Pid(), "RssFile:")
	r.heap0 = metric(ctx, a, "go_memstats_heap_inuse_bytes", "")
	if _, err := env.CreateNamespace(ctx, "bench-plain", nil); err != nil {
		return nil, err
	}
	if _, err := env.CreateNamespace(ctx, "bench", map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}); err != nil {
		return nil, err
	}

	cpu0 := cpuOf(a.Pid())
	var profile func() error
	if c.profileDir != "" {
		profile = startCPUProfile(ctx, c)
	}
	var pods []*e2eenv.Pod
	var start time.Time
	if c.interleave {
		// Baseline and ours burst by burst: each baseline burst through
		// the chain without our plugin, deleted, then a burst of ours.
		step(fmt.Sprintf("interleaved: %d pods without ambientd-cni and %d with it, bursts of %d", c.pods, c.pods, c.burst))
		start = time.Now()
		for first := 0; first < c.pods; first += c.burst {
			n := min(c.burst, c.pods-first)
			plain, durs, errs := createBurst(ctx, env, "bench-plain", env.PlainChain, first, n)
			if errs > 0 {
				return nil, fmt.Errorf("baseline: %d of %d pods failed", errs, n)
			}
			r.plainAdd = append(r.plainAdd, durs...)
			if err := deletePods(ctx, env, plain, c.burst); err != nil {
				return nil, err
			}
			ours, durs, errs := createBurst(ctx, env, "bench", nil, first, n)
			if errs > 0 {
				return nil, fmt.Errorf("ambient: %d of %d CNI ADDs failed", errs, n)
			}
			pods, r.meshAdd = append(pods, ours...), append(r.meshAdd, durs...)
		}
		r.createWall = time.Since(start)
	} else {
		// Baseline: the same chain without our plugin, same bursts, same run.
		step(fmt.Sprintf("baseline: %d pods through the chain without ambientd-cni", c.pods))
		plain, durs, errs := createPods(ctx, env, "bench-plain", env.PlainChain, c)
		if errs > 0 {
			return nil, fmt.Errorf("baseline: %d of %d pods failed", errs, c.pods)
		}
		r.plainAdd = durs
		if err := deletePods(ctx, env, plain, c.burst); err != nil {
			return nil, err
		}

		// Ambient pods through the chain with our plugin.
		step(fmt.Sprintf("ambient: %d pods through the chain with ambientd-cni", c.pods))
		cpu0 = cpuOf(a.Pid())
		start = time.Now()
		pods, durs, errs = createPods(ctx, env, "bench", nil, c)
		r.createWall = time.Since(start)
		r.meshAdd, r.addErrors = durs, errs
		if errs > 0 {
			return nil, fmt.Errorf("ambient: %d of %d CNI ADDs failed", errs, c.pods)
		}
	}
	r.execLoP, r.execBrP = env.PlainChain.ExecDurations("loopback", "ADD"), env.PlainChain.ExecDurations("bridge", "ADD")
	if err := waitEnabled(ctx, env, a, c.pods, start, r); err != nil {
		return nil, err
	}
	r.cpu1, r.rss1 = cpuOf(a.Pid())-cpu0, peakRSS(a.Pid())
	r.cpuPods = r.cpu1 / time.Duration(c.pods)
	if profile != nil {
		if err := profile(); err != nil {
			return nil, err
		}
	}
	r.rssAnon1, r.rssFile1 = statusKiB(a.Pid(), "RssAnon:"), statusKiB(a.Pid(), "RssFile:")
	r.heap1 = metric(ctx, a, "go_memstats_heap_inuse_bytes", "")
	r.runtime1 = runtimeMemory(ctx, a)
	r.execLoM, r.execBrM = env.Chain.ExecDurations("loopback", "ADD"), env.Chain.ExecDurations("bridge", "ADD")
	r.execOursAdd = env.Chain.ExecDurations("ambientd-cni", "ADD")
	if sum, n := metric(ctx, a, "ambientd_cni_add_duration_seconds_sum", `outcome="enrolled"`), metric(ctx, a, "ambientd_cni_add_duration_seconds_count", `outcome="enrolled"`); n > 0 {
		r.agentAddMean = time.Duration(sum / n * float64(time.Second))
	}
	r.steps = map[string]time.Duration{}
	for _, st := range stepNames {
		l := `step="` + st + `"`
		if sum, n := metric(ctx, a, "ambientd_enrollment_step_duration_seconds_sum", l), metric(ctx, a, "ambientd_enrollment_step_duration_seconds_count", l); n > 0 {
			r.steps[st] = time.Duration(sum / n * float64(time.Second))
		}
	}
	r.plugin = pluginLog(env.CNIPluginLog, "bench")
	r.pluginCall = r.plugin["took"]
	r.addSteps = histograms(ctx, a, "ambientd_cni_add_step_duration_seconds", "step")
	r.execOurs = execCost(ctx, env.Bins.CNIPlugin)
	r.execBridge = execCost(ctx, filepath.Join(env.Bins.CNIRefDir, "bridge"))

	// One verification pass over every pod's rules.
	step("verification pass")
	if r.verify, r.verifyDrift, r.mode, err = verifyAll(ctx, pods, c.verifyWorkers); err != nil {
		return nil, err
	}

	// Restart with all N enrolled: time to the new ztunnel snapshot's ack
	// (/readyz) and to every pod enabled again (rules re-applied).
	step("restart")
	if err := a.Stop(30 * time.Second); err != nil {
		return nil, err
	}
	start = time.Now()
	if err := a.Start(); err != nil {
		return nil, err
	}
	if _, err := pollUntil(ctx, 5*time.Millisecond, func() bool { return ready(ctx, a) }); err != nil {
		return nil, fmt.Errorf("restart: never ready: %w", err)
	}
	r.restartAck = time.Since(start)
	if _, err := pollUntil(ctx, 10*time.Millisecond, func() bool {
		return metric(ctx, a, "ambientd_pods", `phase="enabled"`) == float64(c.pods)
	}); err != nil {
		return nil, fmt.Errorf("restart: pods never all enabled again: %w", err)
	}
	r.restartEnabled = time.Since(start)
	r.snapshotAdds = lastSnapshotSize(ctx, em)

	// Removal of all N: CNI DEL, sandbox and object, until the agent and
	// the emulator hold none.
	step("removal")
	start = time.Now()
	if err := deletePods(ctx, env, pods, c.burst); err != nil {
		return nil, err
	}
	if _, err := pollUntil(ctx, 10*time.Millisecond, func() bool {
		n := 0.0
		for _, p := range []string{"pending", "unverified", "enabled", "releasing"} {
			n += metric(ctx, a, "ambientd_pods", `phase="`+p+`"`)
		}
		return n == 0
	}); err != nil {
		return nil, fmt.Errorf("removal: agent still holds pods: %w", err)
	}
	r.removal = time.Since(start)
	r.cpu2, r.rss2 = cpuOf(a.Pid()), peakRSS(a.Pid()) // the restarted process's whole life
	return r, nil
}

// freeAddr is a free loopback TCP address.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// startCPUProfile starts the agent's CPU profile of c.profileSeconds; the
// func it returns waits for it, writes it (cpu.pprof) and the allocation
// and heap profiles of that moment (allocs.pprof, heap.pprof) to
// c.profileDir.
func startCPUProfile(ctx context.Context, c config) func() error {
	done := make(chan error, 1)
	fetch := func(path, file string, timeout time.Duration) error {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		req, err := http.NewRequestWithContext(cctx, http.MethodGet, "http://"+c.pprofAddr+path, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return fmt.Errorf("pprof %s: %w", path, err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("pprof %s: %s", path, resp.Status)
		}
		f, err := os.Create(filepath.Join(c.profileDir, file))
		if err != nil {
			return err
		}
		_, err = io.Copy(f, resp.Body)
		return errors.Join(err, f.Close())
	}
	go func() {
		done <- fetch(fmt.Sprintf("/debug/pprof/profile?seconds=%d", c.profileSeconds), "cpu.pprof", time.Duration(c.profileSeconds)*time.Second+time.Minute)
	}()
	return func() error {
		if err := <-done; err != nil {
			return err
		}
		return errors.Join(fetch("/debug/pprof/allocs", "allocs.pprof", time.Minute), fetch("/debug/pprof/heap", "heap.pprof", time.Minute))
	}
}

func step(s string) { fmt.Fprintf(os.Stderr, "bench: %s (%s)\n", s, time.Now().Format(time.TimeOnly)) }

// createBurst creates n pods p-<first>… at once in namespace through
// chain (nil: the env's chain with our plugin).
func createBurst(ctx context.Context, env *e2eenv.Env, namespace string, chain *e2eenv.Chain, first, n int) ([]*e2eenv.Pod, []time.Duration, int) {
	return createPods(ctx, env, namespace, chain, config{pods: first + n, burst: n, first: first})
}

// createPods creates c.pods pods in namespace through chain (nil: the env's
// chain with our plugin), c.burst at once per burst, and returns them with
// each chain ADD's duration and the number that failed.
func createPods(ctx context.Context, env *e2eenv.Env, namespace string, chain *e2eenv.Chain, c config) ([]*e2eenv.Pod, []time.Duration, int) {
	var (
		mu    sync.Mutex
		pods  []*e2eenv.Pod
		durs  []time.Duration
		fails atomic.Int32
	)
	for first := c.first; first < c.pods; first += c.burst {
		var wg sync.WaitGroup
		for i := first; i < min(first+c.burst, c.pods); i++ {
			wg.Go(func() {
				p, err := env.CreatePod(ctx, e2eenv.PodSpec{Namespace: namespace, Name: fmt.Sprintf("p-%04d", i), Chain: chain})
				if err != nil {
					if fails.Add(1) <= 3 {
						fmt.Fprintf(os.Stderr, "bench: pod %s/p-%04d: %v\n", namespace, i, err)
					}
					return
				}
				mu.Lock()
				pods, durs = append(pods, p), append(durs, p.AddDuration)
				mu.Unlock()
			})
		}
		wg.Wait()
	}
	return pods, durs, int(fails.Load())
}

func deletePods(ctx context.Context, env *e2eenv.Env, pods []*e2eenv.Pod, burst int) error {
	var errs []error
	var mu sync.Mutex
	for first := 0; first < len(pods); first += burst {
		var wg sync.WaitGroup
		for _, p := range pods[first:min(first+burst, len(pods))] {
			wg.Go(func() {
				if err := env.DeletePod(ctx, p); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	if len(errs) > 0 {
		return fmt.Errorf("%d pods not deleted, first: %w", len(errs), errs[0])
	}
	return nil
}

// waitEnabled polls the agent (registry: ambientd_pods) and the API
// (annotation) until all n pods are enabled, recording when each got there.
func waitEnabled(ctx context.Context, env *e2eenv.Env, a *e2eenv.Agent, n int, start time.Time, r *result) error {
	_, err := pollUntil(ctx, 20*time.Millisecond, func() bool {
		if r.allEnabledAgent == 0 && metric(ctx, a, "ambientd_pods", `phase="enabled"`) == float64(n) {
			r.allEnabledAgent = time.Since(start)
		}
		list, err := env.CP.Admin.CoreV1().Pods("bench").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		k := 0
		for _, p := range list.Items {
			if p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled {
				k++
			}
		}
		if k == n && r.allAnnotated == 0 {
			r.allAnnotated = time.Since(start)
		}
		return r.allEnabledAgent != 0 && r.allAnnotated != 0
	})
	if err != nil {
		return fmt.Errorf("pods never all enabled (agent %v, annotated %v): %w", r.allEnabledAgent, r.allAnnotated, err)
	}
	return nil
}

// verifyAll runs iptables.VerifyPod (what the agent's drift verification
// runs per pod) over every pod, workers at once, with the agent's defaults.
func verifyAll(ctx context.Context, pods []*e2eenv.Pod, workers int) (time.Duration, int, string, error) {
	m, err := iptables.NewManager(ctx, iptables.Config{IPv6: true}, nil)
	if err != nil {
		return 0, 0, "", err
	}
	opts, err := podopts.PodOptions(true, nil)
	if err != nil {
		return 0, 0, "", err
	}
	var drift atomic.Int32
	var firstErr error
	var mu sync.Mutex
	work := make(chan *e2eenv.Pod)
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for p := range work {
				d, err := m.VerifyPod(ctx, p.Netns, opts)
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
				if !d.Empty() {
					drift.Add(1)
				}
			}
		})
	}
	for _, p := range pods {
		work <- p
	}
	close(work)
	wg.Wait()
	return time.Since(start), int(drift.Load()), string(m.Mode()), firstErr
}

func pollUntil(ctx context.Context, every time.Duration, cond func() bool) (time.Duration, error) {
	start := time.Now()
	for !cond() {
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(every):
		}
	}
	return time.Since(start), nil
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

func ready(ctx context.Context, a *e2eenv.Agent) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+a.HealthAddr+"/readyz", nil)
	if err != nil {
		return false
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// metric reads one sample of the agent's /metrics (0 when absent or unreadable).
func metric(ctx context.Context, a *e2eenv.Agent, name, labels string) float64 {
	v, _ := a.Metric(ctx, name, labels)
	return v
}

// lastSnapshotSize is how many Adds/Keeps the newest ztunnel connection got
// in its snapshot.
func lastSnapshotSize(ctx context.Context, em *e2eenv.Emulator) int {
	var st struct {
		Connections []struct {
			Snapshot []struct{} `json:"snapshot"`
		} `json:"connections"`
	}
	if err := em.State(ctx, &st); err != nil || len(st.Connections) == 0 {
		return -1
	}
	return len(st.Connections[len(st.Connections)-1].Snapshot)
}

// cpuOf returns the process's user+system CPU time (/proc/pid/stat).
func cpuOf(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100 // USER_HZ is 100 on Linux
}

// runtimeMemory is the row of the Go runtime's memory besides the heap in
// use: what the rest of the agent's anonymous RSS is made of.
func runtimeMemory(ctx context.Context, a *e2eenv.Agent) string {
	mib := func(name string) float64 { return metric(ctx, a, name, "") / (1 << 20) }
	return fmt.Sprintf("%.1f / %.1f / %.1f / %.1f MiB; %.0f, %.0f",
		mib("go_memstats_heap_idle_bytes")-mib("go_memstats_heap_released_bytes"), mib("go_memstats_stack_inuse_bytes"),
		mib("go_memstats_gc_sys_bytes"), mib("go_memstats_other_sys_bytes")+mib("go_memstats_mspan_inuse_bytes")+mib("go_memstats_mcache_inuse_bytes")+mib("go_memstats_buck_hash_sys_bytes"),
		metric(ctx, a, "go_goroutines", ""), metric(ctx, a, "go_threads", ""))
}

// peakRSS returns VmHWM of the process in KiB.
func peakRSS(pid int) int64 { return statusKiB(pid, "VmHWM:") }

// statusKiB reads one "<key> N kB" line of /proc/<pid>/status (0 if absent).
func statusKiB(pid int, key string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), key); ok {
			v, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return v
		}
	}
	return 0
}

func pct(d []time.Duration, p float64) time.Duration { return e2eenv.Percentile(d, p) }

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }

func sec(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// agentBackend is the rule backend the agent says it chose at start: the
// mode of its first "rule backend" log line, or what its flag pinned.
func agentBackend(logPath string) string {
	f, err := os.Open(logPath)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, "rule backend") {
			continue
		}
		for _, key := range []string{`"mode":"`, "mode="} {
			if _, rest, ok := strings.Cut(line, key); ok {
				mode, _, _ := strings.Cut(rest, `"`)
				mode, _, _ = strings.Cut(mode, " ")
				return mode
			}
		}
	}
	return "unknown (no rule backend line in " + logPath + ")"
}

func (r *result) markdown() string {
	var b strings.Builder
	n := r.cfg.pods
	fmt.Fprintf(&b, "\n### %d pods, bursts of %d — %s\n\n", n, r.cfg.burst, time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(&b, "Machine: %s. The agent's rule backend (its log): %s; the bench's verifier: %s.", r.machine, r.agentBackend, r.mode)
	if r.cfg.interleave {
		b.WriteString(" Baseline and ours interleaved burst by burst.")
	}
	if r.cfg.agentArgs != "" {
		fmt.Fprintf(&b, " Agent flags: `%s`.", r.cfg.agentArgs)
	}
	b.WriteString("\n\n| measure | value |\n|---|---|\n")
	row := func(k, v string) { fmt.Fprintf(&b, "| %s | %s |\n", k, v) }
	for _, q := range []struct {
		name string
		p    float64
	}{{"p50", .5}, {"p90", .9}, {"p99", .99}} {
		pl, me := pct(r.plainAdd, q.p), pct(r.meshAdd, q.p)
		row("CNI ADD through the chain "+q.name+": without our plugin → with it (added)",
			fmt.Sprintf("%s → %s (**+%s**)", ms(pl), ms(me), ms(me-pl)))
	}
	row("our plugin's agent call (gRPC connect + agent) p50 / p90 / p99, from its log",
		ms(pct(r.pluginCall, .5))+" / "+ms(pct(r.pluginCall, .9))+" / "+ms(pct(r.pluginCall, .99)))
	row("each plugin process's ADD as libcni ran it (exec to exit), p50: loopback / bridge without → with our plugin / ambientd-cni",
		fmt.Sprintf("%s → %s / %s → %s / %s", ms(pct(r.execLoP, .5)), ms(pct(r.execLoM, .5)), ms(pct(r.execBrP, .5)), ms(pct(r.execBrM, .5)), ms(pct(r.execOursAdd, .5))))
	row("agent's own time per enrolled ADD (mean of ambientd_cni_add_duration_seconds)", ms(r.agentAddMean))
	var bd []string
	for _, name := range addStepNames {
		h := r.addSteps[name]
		bd = append(bd, fmt.Sprintf("%s %s / %s", name, ms(h.quantile(.5)), ms(h.mean())))
	}
	row("CNI ADD breakdown, ambientd_cni_add_step_duration_seconds by step: p50 (from the buckets) / mean", strings.Join(bd, ", "))
	var pl []string
	for _, k := range pluginKeys {
		pl = append(pl, k+" "+ms(pct(r.plugin[k], .5)))
	}
	if ours, total := pct(r.execOursAdd, .5), pct(r.plugin["total"], .5); total > 0 {
		pl = append(pl, "exec to Go code + exit (libcni's exec-to-exit p50 − total p50) "+ms(ours-total))
	}
	row("our plugin's own breakdown per ADD, p50, from its log (init: Go code → ADD handler; config; took: the agent call, agent: the agent's part of it; reply: printing the result; total: since its Go code began)", strings.Join(pl, ", "))
	var st []string
	for _, name := range stepNames {
		st = append(st, name+" "+ms(r.steps[name]))
	}
	row("agent's enrollment steps (means; status_write is async, after the ADD answered)", strings.Join(st, ", "))
	row("exec of a plugin binary alone (VERSION, p50 of 20): ambientd-cni / bridge", ms(r.execOurs)+" / "+ms(r.execBridge))
	row("ADD errors / timeouts", strconv.Itoa(r.addErrors))
	row("create all N (API object, sandbox, chain, status Running)", sec(r.createWall))
	row("first create → all N enabled in the agent (ambientd_pods)", sec(r.allEnabledAgent))
	row("first create → all N annotated enabled (API)", sec(r.allAnnotated))
	row("agent CPU during create + enable (of the ambient pods; interleaved: the whole run); per ambient pod", sec(r.cpu1)+"; "+ms(r.cpuPods))
	row("agent peak RSS (VmHWM): ready with 0 pods → with N enrolled", fmt.Sprintf("%.1f MiB → %.1f MiB", float64(r.rss0)/1024, float64(r.rss1)/1024))
	row("agent RSS ready with 0 pods → with N enrolled: anonymous (heap, stacks) / file-backed (its executable's pages, shared and reclaimable)",
		fmt.Sprintf("%.1f / %.1f MiB → %.1f / %.1f MiB", float64(r.rssAnon0)/1024, float64(r.rssFile0)/1024, float64(r.rssAnon1)/1024, float64(r.rssFile1)/1024))
	row("agent Go heap in use (go_memstats_heap_inuse_bytes): 0 pods → N enrolled", fmt.Sprintf("%.1f MiB → %.1f MiB", r.heap0/(1<<20), r.heap1/(1<<20)))
	row("agent's other Go runtime memory with N enrolled (go_memstats_*): heap idle not yet returned / stacks / GC metadata / other; goroutines, threads", r.runtime1)
	row(fmt.Sprintf("one verification pass (VerifyPod ×N with the agent's defaults, %d at once, timed by the bench; the agent's own pass is ambientd_verify_pass_duration_seconds)", r.cfg.verifyWorkers),
		fmt.Sprintf("%s (%d pods with drift)", sec(r.verify), r.verifyDrift))
	row("restart → snapshot acked (/readyz), N enrolled", fmt.Sprintf("%s (snapshot of %d)", sec(r.restartAck), r.snapshotAdds))
	row("restart → all N enabled in the new registry (every restored pod's rules verified first)", sec(r.restartEnabled))
	row("removal of all N (CNI DEL + sandbox + object) → agent holds none", sec(r.removal))
	row("agent CPU from restart through removal; peak RSS after restart", fmt.Sprintf("%s; %.1f MiB", sec(r.cpu2), float64(r.rss2)/1024))
	return b.String()
}
