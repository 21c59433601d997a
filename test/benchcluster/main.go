// Command benchcluster is the many-node benchmark of the control plane's
// cost (`make bench-cluster`): N hollow nodes — each a Node object, a
// network namespace of its own with a link to the apiserver, the real agent
// (bin/ambientd) in it and a ztunnel emulator on its socket, and no kubelet
// or pod sandbox, in the spirit of Kubernetes' kubemark — against one real
// kube-apiserver + etcd. It measures, from the apiserver's audit log (the
// agents' requests, per node by the address each came from) and its own
// /metrics (every client: watchers, watch events, LIST bytes, etcd writes)
// plus the apiserver's and etcd's CPU, these phases: the agents' first
// start, steady state, a rolling restart of every agent, an apiserver
// restart, pod churn on a few nodes (pods that exist only in the API), and a
// ztunnel outage on every node and its end. It prints Markdown tables and an
// extrapolation to 5,000 nodes × 110 pods.
//
// With -check (make bench-cluster-check) it also fails unless every agent
// reached Ready, every phase produced numbers, and the steady state cost no
// request but watches.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// config is the benchmark's settings; each flag has an environment variable.
type config struct {
	agents       int
	startBatch   int           // agents started at once; the next batch waits for their readiness
	startTimeout time.Duration // a batch's wait for readiness
	steady       time.Duration // the steady-state window
	settle       time.Duration // the window kept open after each action
	restartBatch int           // agents restarted at once (a DaemonSet's maxUnavailable)
	afterAPI     time.Duration // the window after the apiserver is back
	churn        time.Duration // the pod churn's length
	churnNodes   int           // nodes that get pods
	churnPods    int           // pods per node per round
	outage       time.Duration // how long every ztunnel is gone
	apf          bool          // apply deploy/apf.yaml before the agents start
	agentArgs    string
	out          string
	check        bool
	timeout      time.Duration
}

func main() {
	var c config
	flag.IntVar(&c.agents, "agents", e2eenv.EnvInt("BENCH_AGENTS", 100), "hollow nodes, each with its agent (env BENCH_AGENTS)")
	flag.IntVar(&c.startBatch, "start-batch", e2eenv.EnvInt("BENCH_START_BATCH", 10), "agents started at once; the next batch starts once they are ready (env BENCH_START_BATCH)")
	flag.DurationVar(&c.startTimeout, "start-timeout", e2eenv.EnvDuration("BENCH_START_TIMEOUT", 3*time.Minute), "how long a batch of agents may take to be ready; one that is not is stopped and left out (with -check: the run fails) (env BENCH_START_TIMEOUT)")
	flag.DurationVar(&c.steady, "steady", e2eenv.EnvDuration("BENCH_STEADY", 2*time.Minute), "steady-state window (env BENCH_STEADY)")
	flag.DurationVar(&c.settle, "settle", e2eenv.EnvDuration("BENCH_SETTLE", 15*time.Second), "how long each phase's window stays open after its action (env BENCH_SETTLE)")
	flag.IntVar(&c.restartBatch, "restart-batch", e2eenv.EnvInt("BENCH_RESTART_BATCH", 1), "agents restarted at once in the rolling restart (env BENCH_RESTART_BATCH)")
	flag.DurationVar(&c.afterAPI, "after-apiserver", e2eenv.EnvDuration("BENCH_AFTER_APISERVER", time.Minute), "window after the restarted apiserver has every watch back (env BENCH_AFTER_APISERVER)")
	flag.DurationVar(&c.churn, "churn", e2eenv.EnvDuration("BENCH_CHURN", time.Minute), "pod churn length (env BENCH_CHURN)")
	flag.IntVar(&c.churnNodes, "churn-nodes", e2eenv.EnvInt("BENCH_CHURN_NODES", 5), "nodes that get the churned pods (env BENCH_CHURN_NODES)")
	flag.IntVar(&c.churnPods, "churn-pods", e2eenv.EnvInt("BENCH_CHURN_PODS", 10), "pods per node created, then deleted, each round (env BENCH_CHURN_PODS)")
	flag.DurationVar(&c.outage, "outage", e2eenv.EnvDuration("BENCH_OUTAGE", 30*time.Second), "how long every ztunnel is gone (env BENCH_OUTAGE)")
	flag.BoolVar(&c.apf, "apf", e2eenv.EnvBoolOr("BENCH_APF", true), "apply the shipped FlowSchema and PriorityLevelConfiguration (deploy/apf.yaml) before the agents start, as the chart does (env BENCH_APF)")
	flag.StringVar(&c.agentArgs, "agent-args", os.Getenv("BENCH_AGENT_ARGS"), "extra flags for `ambientd run`, space separated (env BENCH_AGENT_ARGS)")
	flag.StringVar(&c.out, "out", os.Getenv("BENCH_OUT"), "also append the tables to this file (env BENCH_OUT)")
	flag.BoolVar(&c.check, "check", e2eenv.EnvBool("BENCH_CHECK"), "fail unless every agent is ready, every phase produced numbers and the steady state cost nothing but watches (env BENCH_CHECK)")
	flag.DurationVar(&c.timeout, "timeout", e2eenv.EnvDuration("BENCH_TIMEOUT", time.Hour), "give up after this long (env BENCH_TIMEOUT)")
	flag.Parse()
	if err := c.validate(); err != nil {
		fmt.Fprintf(os.Stderr, "bench-cluster: %v\n", err)
		os.Exit(2)
	}
	opts := e2eenv.Options{
		NodeName: "bench-cluster-admin", AmbientPlugin: true,
		// The agents reach the apiserver over the hollow nodes' bridge.
		APIServerArgs: []string{"--bind-address=0.0.0.0"},
		ServingIPs:    []net.IP{net.ParseIP(bridgeIP)},
	}
	os.Exit(e2eenv.Program(opts, func(ctx context.Context, env *e2eenv.Env) int {
		ctx, cancel := context.WithTimeout(ctx, c.timeout)
		defer cancel()
		r, err := run(ctx, env, c)
		if r != nil && len(r.phases) > 0 {
			out := r.markdown()
			fmt.Print(out)
			if c.out != "" {
				if werr := appendFile(c.out, out); werr != nil {
					err = errors.Join(err, werr)
				}
			}
		}
		if err == nil && c.check {
			err = r.check()
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench-cluster: FAIL: %v\n", err)
			return 1
		}
		return 0
	}))
}

func (c config) validate() error {
	switch {
	case c.agents < 1 || c.agents > 1000:
		return errors.New("-agents must be 1..1000")
	case c.startBatch < 1 || c.restartBatch < 1 || c.churnPods < 1 || c.churnNodes < 1:
		return errors.New("-start-batch, -restart-batch, -churn-nodes and -churn-pods must be positive")
	case c.steady <= 0 || c.churn <= 0 || c.outage <= 0 || c.settle < 0 || c.afterAPI < 0 || c.startTimeout <= 0:
		return errors.New("-steady, -churn, -outage and -start-timeout must be positive, -settle and -after-apiserver not negative")
	}
	return nil
}

func appendFile(path, s string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	_, err = io.WriteString(f, s)
	return errors.Join(err, f.Close())
}
