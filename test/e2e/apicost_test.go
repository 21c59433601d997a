//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// quietWindow is how long the steady state is watched: two minutes, as the
// budget states (docs/scale.md); AMBIENTD_E2E_QUIET shortens it for a
// quick local run.
func quietWindow(t *testing.T) time.Duration {
	if v := os.Getenv("AMBIENTD_E2E_QUIET"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("AMBIENTD_E2E_QUIET=%q: %v", v, err)
		}
		return d
	}
	return 2 * time.Minute
}

// agentRequests are the requests the agent's identity made in [from, to),
// from the apiserver's audit log.
func agentRequests(t *testing.T, from, to time.Time) []e2eenv.AuditRequest {
	t.Helper()
	reqs, err := testEnv.CP.AuditRequests(from, to, e2eenv.AgentUser)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// nonWatch drops watches: a watch the agent holds is renewed by client-go
// on its own schedule (5 to 10 minutes), it is not a request the agent's
// logic makes.
func nonWatch(reqs []e2eenv.AuditRequest) []e2eenv.AuditRequest {
	var out []e2eenv.AuditRequest
	for _, r := range reqs {
		if r.Verb != "watch" {
			out = append(out, r)
		}
	}
	return out
}

// waitAgentQuiet waits until the agent made no request but watches for
// 3 s, and returns when its last one was received.
func waitAgentQuiet(t *testing.T, ctx context.Context, since time.Time) time.Time {
	t.Helper()
	const quiet = 3 * time.Second
	var last time.Time
	testutil.Until(t, ctx, "the agent quiet for 3s", func() bool {
		last = since
		for _, r := range nonWatch(agentRequests(t, since, time.Now().Add(time.Hour))) {
			last = r.Received
		}
		return time.Since(last) > quiet
	})
	return last
}

// deleteAsKubelet deletes a pod in the kubelet's order: the object is
// marked for deletion (a graceful delete), the containers stop, then the
// sandbox goes (CNI DEL) and the kubelet removes the object. The DEL comes
// once agent a's informer has had the terminating pod (its pod update
// events, nodeagent_reconcile_events_total, moved): the kubelet's DEL
// follows the containers' stop, seconds later.
func deleteAsKubelet(t *testing.T, ctx context.Context, a *e2eenv.Agent, p *e2eenv.Pod) {
	t.Helper()
	const updates = `type="update"`
	before := metricValue(t, ctx, a, "nodeagent_reconcile_events_total", updates)
	grace := int64(30)
	if err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, ctx, "the agent's informer has the terminating pod", func() bool {
		return metricValue(t, ctx, a, "nodeagent_reconcile_events_total", updates) > before
	})
	if err := testEnv.DeletePod(ctx, p); err != nil {
		t.Fatal(err)
	}
}

func listing(reqs []e2eenv.AuditRequest) string {
	var b strings.Builder
	for _, r := range reqs {
		fmt.Fprintf(&b, "\n\t%s", r)
	}
	return b.String()
}

// TestAPICostPerNode: what one node's agent asks of the API server, counted
// from the apiserver's own audit log (every request of the agent's
// identity), held to the per-node budget of docs/scale.md: a quiet node
// costs nothing but its watches; one pod's life costs at most 2 requests,
// all writes, no Event; an agent restart on a node with nothing to change
// costs at most 5 requests.
func TestAPICostPerNode(t *testing.T) {
	quiet := quietWindow(t)
	s := newScenario(t, "apicost", within(quiet+6*time.Minute))
	ctx := s.ctx
	for i := range 3 {
		p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: fmt.Sprintf("steady-%d", i), Mutate: gated})
		waitAnnotation(t, ctx, p, "enabled")
	}
	settled := waitAgentQuiet(t, ctx, time.Now().Add(-time.Minute))

	// Steady state: only watches.
	from := time.Now()
	select {
	case <-ctx.Done():
		t.Fatal(ctx.Err())
	case <-time.After(quiet):
	}
	steady := nonWatch(agentRequests(t, from, time.Now()))
	t.Logf("steady state, %v after the agent settled at %s: %s", quiet, settled.Format("15:04:05"), e2eenv.Summary(steady))
	if len(steady) > 0 {
		t.Errorf("a quiet node cost %d requests in %v, want none but watches:%s", len(steady), quiet, listing(steady))
	}

	// One pod's life: created, enrolled, deleted.
	from = time.Now()
	// Gated, as admission makes every pod of an ambient namespace (an
	// ungated one costs one Event more, once: ReadinessGateMissing).
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "life", Mutate: gated})
	waitAnnotation(t, ctx, p, "enabled")
	deleteAsKubelet(t, ctx, s.agent, p)
	waitAgentQuiet(t, ctx, from)
	life := nonWatch(agentRequests(t, from, time.Now()))
	t.Logf("one pod's life: %d requests: %s", len(life), e2eenv.Summary(life))
	if len(life) == 0 {
		t.Fatal("the audit log shows no request for a pod the agent enrolled (its annotation): the count is not working")
	}
	if len(life) > 2 {
		t.Errorf("one pod's life cost %d requests, want at most 2:%s", len(life), listing(life))
	}
	for _, r := range life {
		if !r.Write() || r.Resource == "events" {
			t.Errorf("one pod's life: %s, want writes to the pod only, no Event", r)
		}
	}

	// A restart on a node with nothing to change.
	from = time.Now()
	if err := s.agent.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	startAgentWith(t, ctx, e2eenv.AgentConfig{})
	waitAgentQuiet(t, ctx, from)
	restart := agentRequests(t, from, time.Now())
	t.Logf("a restart: %d requests: %s", len(restart), e2eenv.Summary(restart))
	if len(restart) > 5 {
		t.Errorf("an agent restart cost %d requests, want at most 5:%s", len(restart), listing(restart))
	}
}
