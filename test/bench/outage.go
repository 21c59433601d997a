package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// The ztunnel-outage scenario (-scenario=ztunnel-outage): N enrolled pods,
// the only ztunnel killed, a new one started once all of them are False;
// repeated -outages times. It measures, from a watch of every pod version:
// the end of the grace → every pod False/ZtunnelUnavailable, the new
// ztunnel's snapshot ack → every pod True/Enrolled, and the pods/status
// writes each transition cost (the watch's versions and the agent's
// ambientd_annotation_writes_total).

// outage is one outage's numbers.
type outage struct {
	firstFalse, allFalse time.Duration // from the end of the grace
	firstTrue, allTrue   time.Duration // from the new ztunnel's snapshot ack
	writesDown, writesUp float64       // agent's status write attempts per transition
	versionsDown         int           // pod versions the watch saw, kill → all False
	versionsUp           int           // ack → all True
	snapshot             int           // the new ztunnel's snapshot size
	cpu                  time.Duration // agent CPU, kill → all True
}

type outageResult struct {
	cfg            config
	machine, grace string
	enrolled       time.Duration // create → all N True
	outages        []outage
}

// podVersions follows every version of the namespace's pods: per pod, the
// condition it shows now; waiters ask for a count of pods in a condition.
type podVersions struct {
	mu      sync.Mutex
	status  map[string]string // pod → "True/Enrolled", …
	changed chan struct{}
	seen    int
}

func (v *podVersions) count(want string) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	n := 0
	for _, s := range v.status {
		if s == want {
			n++
		}
	}
	return n
}

func (v *podVersions) versions() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.seen
}

func conditionOf(p *corev1.Pod) string {
	for _, c := range p.Status.Conditions {
		if string(c.Type) == podmeta.ConditionEnrolled {
			return string(c.Status) + "/" + c.Reason
		}
	}
	return ""
}

// watchVersions lists the namespace's pods and follows them until ctx
// ends. The environment's client gives up on any request after 30 s, a
// watch too: each watch that ends is resumed from the last version seen
// (listed again when that is too old), so no version is missed or counted
// twice.
func watchVersions(ctx context.Context, env *e2eenv.Env, namespace string) (*podVersions, error) {
	pods := env.CP.Admin.CoreV1().Pods(namespace)
	v := &podVersions{status: map[string]string{}, changed: make(chan struct{}, 1)}
	relist := func() (string, error) {
		list, err := pods.List(ctx, metav1.ListOptions{})
		if err != nil {
			return "", err
		}
		v.mu.Lock()
		for _, p := range list.Items {
			v.status[p.Name] = conditionOf(&p)
		}
		v.mu.Unlock()
		return list.ResourceVersion, nil
	}
	rv, err := relist()
	if err != nil {
		return nil, err
	}
	go func() {
		for ctx.Err() == nil {
			w, err := pods.Watch(ctx, metav1.ListOptions{ResourceVersion: rv})
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			for ev := range w.ResultChan() {
				if ev.Type == watch.Error {
					if r, err := relist(); err == nil { // 410 Gone: too old
						rv = r
					}
					break
				}
				p, ok := ev.Object.(*corev1.Pod)
				if !ok {
					continue
				}
				rv = p.ResourceVersion
				v.mu.Lock()
				v.status[p.Name] = conditionOf(p)
				v.seen++
				v.mu.Unlock()
				select {
				case v.changed <- struct{}{}:
				default:
				}
			}
			w.Stop()
		}
	}()
	return v, nil
}

// until waits for n pods in condition want; it returns when the first one
// and the last one got there.
func (v *podVersions) until(ctx context.Context, want string, n int) (first, last time.Time, err error) {
	for {
		k := v.count(want)
		if k > 0 && first.IsZero() {
			first = time.Now()
		}
		if k >= n {
			return first, time.Now(), nil
		}
		select {
		case <-ctx.Done():
			return first, last, fmt.Errorf("%d of %d pods %s: %w", k, n, want, ctx.Err())
		case <-v.changed:
		case <-time.After(time.Second): // a lost signal costs a second, never the run
		}
	}
}

func statusWrites(ctx context.Context, a *e2eenv.Agent) float64 {
	n := 0.0
	for _, r := range []string{"ok", "retry", "dropped"} {
		n += metric(ctx, a, "ambientd_annotation_writes_total", `result="`+r+`"`)
	}
	return n
}

func runOutage(ctx context.Context, env *e2eenv.Env, c config) (*outageResult, error) {
	r := &outageResult{cfg: c, machine: e2eenv.Machine(), grace: agent.DefaultZtunnelGrace.String()}
	em, a, err := startNode(ctx, env, c)
	if err != nil {
		return nil, err
	}
	for _, f := range strings.Fields(c.agentArgs) {
		if g, ok := strings.CutPrefix(f, "--ztunnel-grace="); ok {
			r.grace = g
		}
	}
	grace, err := time.ParseDuration(r.grace)
	if err != nil {
		return nil, err
	}
	if _, err := env.CreateNamespace(ctx, "bench", map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}); err != nil {
		return nil, err
	}
	step(fmt.Sprintf("ztunnel outage: %d pods through the chain with ambientd-cni", c.pods))
	start := time.Now()
	pods, _, errs := createPods(ctx, env, "bench", nil, c)
	if errs > 0 {
		return nil, fmt.Errorf("%d of %d CNI ADDs failed", errs, c.pods)
	}
	v, err := watchVersions(ctx, env, "bench")
	if err != nil {
		return nil, err
	}
	enrolled := "True/" + agent.ReasonEnrolled
	if _, _, err := v.until(ctx, enrolled, c.pods); err != nil {
		return nil, err
	}
	r.enrolled = time.Since(start)

	for i := 1; i <= c.outages; i++ {
		step(fmt.Sprintf("outage %d of %d: killing the only ztunnel", i, c.outages))
		var o outage
		w0, v0, cpu0 := statusWrites(ctx, a), v.versions(), cpuOf(a.Pid())
		killed := time.Now()
		if err := em.Kill(); err != nil {
			return nil, err
		}
		first, last, err := v.until(ctx, "False/"+agent.ReasonZtunnelUnavailable, c.pods)
		if err != nil {
			return nil, err
		}
		graceEnd := killed.Add(grace)
		o.firstFalse, o.allFalse = first.Sub(graceEnd), last.Sub(graceEnd)
		w1, v1 := statusWrites(ctx, a), v.versions()
		o.writesDown, o.versionsDown = w1-w0, v1-v0

		step(fmt.Sprintf("outage %d of %d: a new ztunnel", i, c.outages))
		if em, err = env.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: fmt.Sprintf("ztunnel-%d", i)}); err != nil {
			return nil, err
		}
		var st ztunnelemu.State
		if _, err := pollUntil(ctx, 5*time.Millisecond, func() bool {
			err := em.State(ctx, &st)
			return err == nil && len(st.Connections) > 0 && st.Connections[len(st.Connections)-1].SnapshotSent
		}); err != nil {
			return nil, fmt.Errorf("new ztunnel: no snapshot: %w", err)
		}
		conn := st.Connections[len(st.Connections)-1]
		o.snapshot = len(conn.Snapshot)
		var acked time.Time
		for _, q := range st.RequestsOn(conn.ID) {
			if q.Op == "snapshot_sent" {
				acked = q.At
			}
		}
		first, last, err = v.until(ctx, enrolled, c.pods)
		if err != nil {
			return nil, err
		}
		o.firstTrue, o.allTrue = first.Sub(acked), last.Sub(acked)
		o.writesUp, o.versionsUp = statusWrites(ctx, a)-w1, v.versions()-v1
		o.cpu = cpuOf(a.Pid()) - cpu0
		r.outages = append(r.outages, o)
	}
	step("removal")
	if err := deletePods(ctx, env, pods, c.burst); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *outageResult) markdown() string {
	var b strings.Builder
	n := r.cfg.pods
	fmt.Fprintf(&b, "\n### ztunnel outage, %d pods — %s\n\n", n, time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(&b, "Machine: %s. Grace %s.", r.machine, r.grace)
	if r.cfg.agentArgs != "" {
		fmt.Fprintf(&b, " Agent flags: `%s`.", r.cfg.agentArgs)
	}
	fmt.Fprintf(&b, " %d pods enrolled (create → all True) in %s.\n\n", n, sec(r.enrolled))
	b.WriteString("| outage | end of grace → first / all False | snapshot ack → first / all True (snapshot size) | status writes: down / up (per pod) | pod versions watched: down / up | agent CPU |\n|---|---|---|---|---|---|\n")
	for i, o := range r.outages {
		fmt.Fprintf(&b, "| %d | %s / %s | %s / %s (%d) | %.0f / %.0f (%.2f) | %d / %d | %s |\n", i+1,
			sec(o.firstFalse), sec(o.allFalse), sec(o.firstTrue), sec(o.allTrue), o.snapshot,
			o.writesDown, o.writesUp, (o.writesDown+o.writesUp)/float64(n), o.versionsDown, o.versionsUp, sec(o.cpu))
	}
	return b.String()
}
