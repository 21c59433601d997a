package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// result is a finished (or partly finished) run.
type result struct {
	cfg      config
	machine  string
	date     time.Time
	started  int           // agents started
	ready    int           // of those, ready within -start-timeout
	notReady []string      // the ones that were not, with why
	allReady time.Duration // first start to the last agent ready
	agentRSS int64         // every agent's RSS summed, after the steady state
	baseline snapshot      // before any agent: the apiserver's own watches
	phases   []*phase
	// apiWatchBack is how long the restarted apiserver took to hold as
	// many watches as before; apiWatchNote says if it never did.
	apiWatchBack time.Duration
	apiWatchNote string
	// apf names the APF objects applied (-apf), none when not.
	apf []string
}

// bench is a run in progress.
type bench struct {
	cfg     config
	env     *e2eenv.Env
	scrape  *scraper
	hollows []*hollow
	res     *result
}

func run(ctx context.Context, env *e2eenv.Env, c config) (*result, error) {
	b := &bench{cfg: c, env: env, res: &result{cfg: c, machine: e2eenv.Machine(), date: time.Now().UTC()}}
	var err error
	if b.scrape, err = newScraper(env.CP); err != nil {
		return nil, err
	}
	nsenter, err := nsenterPath()
	if err != nil {
		return nil, err
	}
	hn, err := newHollowNet()
	if err != nil {
		return nil, err
	}
	defer func() {
		// The agents go before their netns and the bridge; the emulators
		// and the control plane are the environment's to stop.
		var errs []error
		for _, h := range b.hollows {
			errs = append(errs, h.close())
		}
		errs = append(errs, hn.close())
		if cerr := errors.Join(errs...); cerr != nil {
			fmt.Fprintf(os.Stderr, "bench-cluster: cleanup: %v\n", cerr)
		}
	}()
	kubeconfig := filepath.Join(env.Dir, "hollow-agent.kubeconfig")
	if err := env.CP.WriteAgentKubeconfigVia(kubeconfig, bridgeIP); err != nil {
		return nil, err
	}
	spec := hollowSpec{env: env, kubeconfig: kubeconfig, agentArgs: splitArgs(c.agentArgs), nsenter: nsenter}

	if c.apf {
		if b.res.apf, err = applyAPF(ctx, env.CP.Admin); err != nil {
			return nil, err
		}
	}
	if b.res.baseline, err = b.scrape.snapshot(ctx); err != nil {
		return nil, err
	}
	steps := []struct {
		name string
		fn   func(context.Context) (*phase, error)
	}{
		{"start", func(ctx context.Context) (*phase, error) { return b.start(ctx, spec, hn) }},
		{"steady", b.steadyState},
		{"rolling restart", b.rollingRestart},
		{"apiserver restart", b.apiserverRestart},
		{"pod churn", b.podChurn},
		{"ztunnel outage", b.ztunnelOutage},
	}
	for _, s := range steps {
		fmt.Fprintf(os.Stderr, "bench-cluster: %s: %s (load %s)\n", time.Now().Format("15:04:05"), s.name, e2eenv.LoadAverage())
		p, err := s.fn(ctx)
		if p != nil {
			b.res.phases = append(b.res.phases, p)
		}
		if err != nil {
			return b.res, fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return b.res, nil
}

// measure runs action in a window that stays open settle longer, with the
// control plane's snapshots on either side and the agents' requests from
// the audit log.
func (b *bench) measure(ctx context.Context, name string, settle time.Duration, action func(ctx context.Context, p *phase) error) (*phase, error) {
	p := &phase{name: name, nodes: len(b.hollows)}
	var err error
	if p.before, err = b.scrape.snapshot(ctx); err != nil {
		return nil, err
	}
	p.from = time.Now()
	if err := action(ctx, p); err != nil {
		return nil, err
	}
	if err := sleep(ctx, settle); err != nil {
		return nil, err
	}
	p.to = time.Now()
	if p.after, err = b.scrape.snapshot(ctx); err != nil {
		return nil, err
	}
	reqs, err := b.env.CP.AuditRequests(p.from, p.to, e2eenv.AgentUser)
	if err != nil {
		return nil, err
	}
	p.reqs = reqs
	p.agent = countAgent(reqs)
	return p, nil
}

// start brings the hollow nodes up in batches: each batch's agents start
// at once, and the next batch starts when they are ready (or
// -start-timeout passed: those are stopped and left out).
func (b *bench) start(ctx context.Context, spec hollowSpec, hn *hollowNet) (*phase, error) {
	return b.measure(ctx, "first start", b.cfg.settle, func(ctx context.Context, p *phase) error {
		t0 := time.Now()
		for first := 0; first < b.cfg.agents; first += b.cfg.startBatch {
			var batch []*hollow
			for i := first; i < min(first+b.cfg.startBatch, b.cfg.agents); i++ {
				h, err := startHollow(ctx, spec, hn, i)
				if err != nil {
					for _, started := range batch {
						err = errors.Join(err, started.close())
					}
					return err
				}
				b.res.started++
				batch = append(batch, h)
			}
			for i, err := range b.waitReady(ctx, batch, b.cfg.startTimeout) {
				h := batch[i]
				if err == nil {
					b.hollows = append(b.hollows, h)
					continue
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
				b.res.notReady = append(b.res.notReady, h.name+": "+err.Error())
				if cerr := h.close(); cerr != nil {
					return cerr
				}
			}
			fmt.Fprintf(os.Stderr, "bench-cluster: %d of %d agents ready after %s (load %s)\n", len(b.hollows), b.res.started, time.Since(t0).Round(time.Second), e2eenv.LoadAverage())
		}
		b.res.ready = len(b.hollows)
		b.res.allReady = time.Since(t0)
		p.nodes, p.touched = len(b.hollows), len(b.hollows)
		p.note = fmt.Sprintf("%d agents started in batches of %d, %d ready in %s", b.res.started, b.cfg.startBatch, b.res.ready, b.res.allReady.Round(time.Second))
		if b.res.ready == 0 {
			return errors.New("no agent became ready")
		}
		return nil
	})
}

// waitReady waits for every agent of hs to be ready, each for at most
// timeout; the errors are by index (nil: ready).
func (b *bench) waitReady(ctx context.Context, hs []*hollow, timeout time.Duration) []error {
	errs := make([]error, len(hs))
	var wg sync.WaitGroup
	for i, h := range hs {
		wg.Go(func() {
			wctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			errs[i] = h.waitReady(wctx)
		})
	}
	wg.Wait()
	return errs
}

// allReady waits for every running agent, and fails naming the first that
// is not ready.
func (b *bench) allReady(ctx context.Context, hs []*hollow, timeout time.Duration) error {
	return errors.Join(b.waitReady(ctx, hs, timeout)...)
}

// steadyState waits until no agent made a request but watches for 5 s
// (at most 2 minutes), then watches the agents for -steady.
func (b *bench) steadyState(ctx context.Context) (*phase, error) {
	if err := b.waitQuiet(ctx, 5*time.Second, 2*time.Minute); err != nil {
		return nil, err
	}
	p, err := b.measure(ctx, "steady state", 0, func(ctx context.Context, p *phase) error {
		p.note = fmt.Sprintf("%d ready agents, no pods, nothing changing", p.nodes)
		return sleep(ctx, b.cfg.steady)
	})
	for _, h := range b.hollows {
		b.res.agentRSS += processRSS(h.agent.Pid())
	}
	return p, err
}

// waitQuiet waits until the agents made no request but watches for quiet,
// or limit passed (then it goes on: the steady state shows what they still
// do).
func (b *bench) waitQuiet(ctx context.Context, quiet, limit time.Duration) error {
	since := time.Now().Add(-time.Minute)
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		reqs, err := b.env.CP.AuditRequests(since, time.Now().Add(time.Hour), e2eenv.AgentUser)
		if err != nil {
			return err
		}
		last := since
		for _, r := range reqs {
			if r.Verb != "watch" && r.Received.After(last) {
				last = r.Received
			}
		}
		if time.Since(last) > quiet {
			return nil
		}
		if err := sleep(ctx, time.Second); err != nil {
			return err
		}
	}
	fmt.Fprintf(os.Stderr, "bench-cluster: the agents were not quiet for %s within %s; measuring anyway\n", quiet, limit)
	return nil
}

// rollingRestart restarts every agent, -restart-batch at a time, each batch
// ready before the next (a DaemonSet rollout with that maxUnavailable).
func (b *bench) rollingRestart(ctx context.Context) (*phase, error) {
	return b.measure(ctx, "rolling restart", b.cfg.settle, func(ctx context.Context, p *phase) error {
		t0 := time.Now()
		for first := 0; first < len(b.hollows); first += b.cfg.restartBatch {
			batch := b.hollows[first:min(first+b.cfg.restartBatch, len(b.hollows))]
			for _, h := range batch {
				if err := h.agent.Restart(10 * time.Second); err != nil {
					return err
				}
			}
			if err := b.allReady(ctx, batch, 2*time.Minute); err != nil {
				return err
			}
		}
		p.touched = len(b.hollows)
		p.note = fmt.Sprintf("%d agents, %d at a time (SIGTERM, start, ready), in %s", len(b.hollows), b.cfg.restartBatch, time.Since(t0).Round(time.Second))
		return nil
	})
}

// apiserverRestart stops kube-apiserver (SIGTERM) and starts it again, waits
// until it holds as many watches as before, and keeps the window open
// -after-apiserver longer.
func (b *bench) apiserverRestart(ctx context.Context) (*phase, error) {
	return b.measure(ctx, "apiserver restart", b.cfg.afterAPI, func(ctx context.Context, p *phase) error {
		before := sumGauge(p.before.metrics, "apiserver_longrunning_requests", "verb=WATCH")
		cp := b.env.CP
		t0 := time.Now()
		// It stops listening at once; the process has been seen to linger
		// past 30 s after that, so it gets the e2e suite's 10 s grace.
		if err := cp.APIServer.Stop(10 * time.Second); err != nil {
			return err
		}
		stopped := time.Since(t0)
		gone := fmt.Sprintf("exited %s after its SIGTERM", stopped.Round(100*time.Millisecond))
		if err := cp.APIServer.ExitError(); err != nil && strings.Contains(err.Error(), "killed") {
			gone = fmt.Sprintf("not exited %s after its SIGTERM, SIGKILLed", stopped.Round(time.Second))
		}
		if err := cp.APIServer.Start(); err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
		if err := cp.WaitReady(rctx); err != nil {
			return err
		}
		up := time.Since(t0) - stopped
		p.readyAt = time.Now()
		var held float64
		for {
			s, err := b.scrape.snapshot(ctx)
			if err != nil {
				return err
			}
			held = sumGauge(s.metrics, "apiserver_longrunning_requests", "verb=WATCH")
			if held >= before {
				b.res.apiWatchBack = time.Since(t0)
				break
			}
			if rctx.Err() != nil {
				b.res.apiWatchNote = fmt.Sprintf("%.0f of %.0f watches back after %s", held, before, time.Since(t0).Round(time.Second))
				break
			}
			if err := sleep(ctx, time.Second); err != nil {
				return err
			}
		}
		p.touched = len(b.hollows)
		p.note = fmt.Sprintf("%s; started, /readyz after %s more; %.0f watches held again (as before) %s after the SIGTERM",
			gone, up.Round(100*time.Millisecond), held, b.res.apiWatchBack.Round(time.Second))
		if b.res.apiWatchNote != "" {
			p.note = fmt.Sprintf("%s; started, /readyz after %s more; %s", gone, up.Round(100*time.Millisecond), b.res.apiWatchNote)
		}
		return nil
	})
}

// podChurn creates -churn-pods pods on each of the first -churn-nodes nodes,
// deletes them, and again, for -churn. The pods exist only in the API
// (bound by spec.nodeName, in an ambient namespace): no sandbox, never
// Running; their node's agent sees them through its informer.
func (b *bench) podChurn(ctx context.Context) (*phase, error) {
	const ns = "churn"
	if _, err := b.env.CreateNamespace(ctx, ns, map[string]string{"istio.io/dataplane-mode": "ambient"}); err != nil {
		return nil, err
	}
	nodes := b.hollows[:min(b.cfg.churnNodes, len(b.hollows))]
	pods := b.env.CP.Admin.CoreV1().Pods(ns)
	return b.measure(ctx, "pod churn (API-only pods)", b.cfg.settle, func(ctx context.Context, p *phase) error {
		end := time.Now().Add(b.cfg.churn)
		zero := int64(0)
		for round := 0; time.Now().Before(end); round++ {
			var names []string
			for _, h := range nodes {
				for j := range b.cfg.churnPods {
					name := fmt.Sprintf("%s-r%d-%d", h.name, round, j)
					pod := &corev1.Pod{
						ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": "churn"}},
						Spec: corev1.PodSpec{
							NodeName:   h.name,
							Containers: []corev1.Container{{Name: "app", Image: "registry.k8s.io/pause:3.10"}},
						},
					}
					if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
						return err
					}
					names = append(names, name)
				}
			}
			if err := sleep(ctx, time.Second); err != nil {
				return err
			}
			for _, name := range names {
				if err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
					return err
				}
			}
			p.pods += len(names)
			if err := sleep(ctx, time.Second); err != nil {
				return err
			}
		}
		p.touched = len(nodes)
		p.note = fmt.Sprintf("%d pods created and deleted on %d nodes in rounds of %d per node (API-only: bound, never running)", p.pods, len(nodes), b.cfg.churnPods)
		return nil
	})
}

// ztunnelOutage stops every node's emulator at once for -outage (one phase),
// then starts them all again and waits until every agent is ready (another).
func (b *bench) ztunnelOutage(ctx context.Context) (*phase, error) {
	down, err := b.measure(ctx, "ztunnel outage, every node", 0, func(ctx context.Context, p *phase) error {
		var wg sync.WaitGroup
		errs := make([]error, len(b.hollows))
		for i, h := range b.hollows {
			wg.Go(func() { errs[i] = h.emulator.Stop(5 * time.Second) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		p.touched = len(b.hollows)
		p.note = fmt.Sprintf("every emulator stopped for %s", b.cfg.outage)
		return sleep(ctx, b.cfg.outage)
	})
	if err != nil {
		return nil, err
	}
	b.res.phases = append(b.res.phases, down)
	return b.measure(ctx, "ztunnel back, every node", b.cfg.settle, func(ctx context.Context, p *phase) error {
		t0 := time.Now()
		for _, h := range b.hollows {
			if err := h.emulator.Start(); err != nil {
				return err
			}
		}
		if err := b.allReady(ctx, b.hollows, 3*time.Minute); err != nil {
			return err
		}
		p.touched = len(b.hollows)
		p.note = fmt.Sprintf("every emulator started again; every agent ready after %s", time.Since(t0).Round(100*time.Millisecond))
		return nil
	})
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
