package agent

import (
	"context"
	"time"
)

// addSteps label ambientd_cni_add_step_duration_seconds, in the order an
// ADD runs them: the plugin's own steps before its call (as it reports
// them), the call reaching the agent, then the agent's steps up to its
// answer. docs/metrics.md ("CNI ADD breakdown") says what each covers.
var addSteps = [...]string{
	"plugin_init", "plugin_config", "dial", "check", "netns", "lookup",
	"queue", "rules", "ztunnel_ack", "probe_ips", "agent",
}

// maxReported bounds a step the plugin reports: a longer one (or a
// negative one, clocks apart) is not a measurement and is dropped.
const maxReported = 5 * time.Minute

// addTrace is one CNI ADD's step durations. Only the ADD's goroutine
// writes it (the steps run one after another), and it is observed once,
// when the ADD answers.
type addTrace struct {
	d    [len(addSteps)]time.Duration
	seen [len(addSteps)]bool
}

type addTraceKey struct{}

// withAddTrace returns ctx carrying a new trace for one ADD.
func withAddTrace(ctx context.Context) (context.Context, *addTrace) {
	t := &addTrace{}
	return context.WithValue(ctx, addTraceKey{}, t), t
}

// traceOf is the ADD's trace in ctx, or nil (a workqueue sync).
func traceOf(ctx context.Context) *addTrace {
	t, _ := ctx.Value(addTraceKey{}).(*addTrace)
	return t
}

// add adds d to step (a step may run more than once: the queue is the
// wait for a slot and then for the pod's lock).
func (t *addTrace) add(step string, d time.Duration) {
	if t == nil {
		return
	}
	for i, s := range addSteps {
		if s == step {
			t.d[i] += d
			t.seen[i] = true
			return
		}
	}
}

// plugin records what the plugin reported and the call's way to the
// agent (its wall clock before the call → the server's on arrival).
func (t *addTrace) plugin(ev PodEvent) {
	report := func(step string, d time.Duration) {
		if d >= 0 && d <= maxReported {
			t.add(step, d)
		}
	}
	if ev.Plugin.Init > 0 {
		report("plugin_init", ev.Plugin.Init)
	}
	if ev.Plugin.Config > 0 {
		report("plugin_config", ev.Plugin.Config)
	}
	if !ev.Plugin.CallStart.IsZero() && !ev.Received.IsZero() {
		report("dial", ev.Received.Sub(ev.Plugin.CallStart))
	}
}

// observe puts every step the ADD ran in the histogram.
func (m *metrics) observe(t *addTrace) {
	for i, s := range addSteps {
		if t.seen[i] {
			m.addSteps.WithLabelValues(s).Observe(t.d[i].Seconds())
		}
	}
}
