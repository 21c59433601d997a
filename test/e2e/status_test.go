//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// ambientdStatus runs `bin/ambientd status` against the test agent's admin
// socket and returns its stdout, stderr and exit code.
func ambientdStatus(t *testing.T, ctx context.Context, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.CommandContext(ctx, testEnv.Bins.Agent, append([]string{"status", "--admin-socket=" + testEnv.AdminSocket}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return out.String(), errb.String(), 0
	case errors.As(err, &ee):
		return out.String(), errb.String(), ee.ExitCode()
	}
	t.Fatalf("run ambientd status: %v", err)
	return "", "", -1
}

// statusJSON runs `ambientd status -o json` and parses it.
func statusJSON(t *testing.T, ctx context.Context) admin.NodeStatus {
	t.Helper()
	out, errOut, code := ambientdStatus(t, ctx, "-o", "json")
	if code != 0 {
		t.Fatalf("ambientd status -o json: exit %d: %s", code, errOut)
	}
	var st admin.NodeStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("ambientd status -o json is not a NodeStatus: %v\n%s", err, out)
	}
	return st
}

func findPod(st admin.NodeStatus, uid string) (admin.Pod, bool) {
	for _, p := range st.Pods {
		if p.UID == uid {
			return p, true
		}
	}
	return admin.Pod{}, false
}

// TestStatus: `ambientd status` shows a pending pod (no ztunnel) with its
// reason, the same pod enabled once a ztunnel acks it, the ztunnel gone
// again, one pod with its live rules, and a clear error in bounded time once
// the agent is down.
func TestStatus(t *testing.T) {
	s := newScenario(t, "status", withoutZtunnel(), agentArgs("--retry-base-delay=10m", "--retry-max-delay=10m"))
	ctx, nsName, a := s.ctx, s.ns, s.agent

	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web"})
	waitAnnotation(t, ctx, p, "pending")

	// Pending: no ztunnel.
	var st admin.NodeStatus
	testutil.Until(t, ctx, "status showing the pod pending", func() bool {
		st = statusJSON(t, ctx)
		got, ok := findPod(st, p.UID)
		return ok && got.Phase == "pending" && got.Annotation == "pending"
	})
	got, _ := findPod(st, p.UID)
	if got.ZtunnelAcked || got.LastError == "" || got.Namespace != nsName || got.Name != "web" {
		t.Errorf("pending pod in status: %+v; want not acked, a last error, %s/web", got, nsName)
	}
	if st.Ztunnel.Connections != 0 || len(st.NotReady) == 0 || st.Node != testEnv.NodeName {
		t.Errorf("status without ztunnel: node %q, ztunnel %+v, not ready %q", st.Node, st.Ztunnel, st.NotReady)
	}
	if st.Phases["pending"] < 1 {
		t.Errorf("phase counts %v: want the pending pod counted", st.Phases)
	}

	// Enabled: a ztunnel takes the pod.
	em := startEmulator(t, ctx, "ztunnel-status")
	waitAnnotation(t, ctx, p, "enabled")
	testutil.Until(t, ctx, "status showing the pod enabled", func() bool {
		st = statusJSON(t, ctx)
		got, ok := findPod(st, p.UID)
		return ok && got.Phase == "enabled" && got.ZtunnelAcked && st.Ztunnel.Connections == 1
	})
	if got, _ := findPod(st, p.UID); got.LastError != "" || got.Created.IsZero() || len(got.IPs) == 0 || got.Netns == "" {
		t.Errorf("enabled pod in status: %+v; want no error, a creation time, IPs and a netns", got)
	}
	table, errOut, code := ambientdStatus(t, ctx)
	if code != 0 {
		t.Fatalf("ambientd status: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"NAMESPACE", "ZTUNNEL ACKED", nsName, "web", "enabled", "ztunnel:     1 connected"} {
		if !strings.Contains(table, want) {
			t.Errorf("status table lacks %q:\n%s", want, table)
		}
	}

	// One pod with its live rules (the same rules the pod's netns holds).
	one, errOut, code := ambientdStatus(t, ctx, "--pod", nsName+"/web")
	if code != 0 {
		t.Fatalf("ambientd status --pod: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"phase:          enabled", "ztunnel acked:  yes", "ISTIO_OUTPUT", "ISTIO_PRERT"} {
		if !strings.Contains(one, want) {
			t.Errorf("status --pod lacks %q:\n%s", want, one)
		}
	}
	jsonOne, _, code := ambientdStatus(t, ctx, "--pod", nsName+"/web", "-o", "json")
	var d admin.PodDetail
	if err := json.Unmarshal([]byte(jsonOne), &d); code != 0 || err != nil || d.Pod.UID != p.UID || !strings.Contains(d.Rules, "ISTIO_OUTPUT") {
		t.Errorf("status --pod -o json: exit %d, err %v, pod %+v, rules %q", code, err, d.Pod, d.Rules)
	}
	if _, errOut, code := ambientdStatus(t, ctx, "--pod", nsName+"/nope"); code == 0 || !strings.Contains(errOut, "no such pod") {
		t.Errorf("status --pod of a missing pod: exit %d, stderr %q; want non-zero and 'no such pod'", code, errOut)
	}

	// Ztunnel gone.
	if err := em.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, ctx, "status showing no ztunnel", func() bool {
		st = statusJSON(t, ctx)
		return st.Ztunnel.Connections == 0 && len(st.NotReady) > 0
	})
	if !strings.Contains(strings.Join(st.NotReady, ";"), "no ztunnel connected") {
		t.Errorf("not-ready reasons %q: want 'no ztunnel connected'", st.NotReady)
	}

	// Agent down: a clear error, non-zero, in bounded time.
	if err := a.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, errOut, code = ambientdStatus(t, ctx, "--timeout=3s")
	took := time.Since(start)
	if code == 0 || !strings.Contains(errOut, "agent not running at "+testEnv.AdminSocket) {
		t.Errorf("status with the agent down: exit %d, stderr %q; want non-zero and 'agent not running at %s'", code, errOut, testEnv.AdminSocket)
	}
	t.Logf("status with the agent down answered in %v", took)
}
