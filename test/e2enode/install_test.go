//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// daemonSetReadyOnlyAfterZtunnel: the node registered with the startup
// taint; the DaemonSet's pod installs the plugin into the node's conflist,
// reports not ready while no ztunnel is connected (the taint stays), and
// turns Ready once the emulator connects and acks its snapshot — the taint
// goes then.
func (r *agentRun) daemonSetReadyOnlyAfterZtunnel(t *testing.T, ctx context.Context) {
	tainted, err := nodeTainted(ctx)
	if err != nil || !tainted {
		t.Fatalf("node should carry the startup taint %s before the agent runs: tainted=%v %v", startupTaint.Key, tainted, err)
	}
	if strings.Contains(conflist(t), `"ambientd-cni"`) || pluginInstalled(t) {
		t.Fatalf("the node's CNI config mentions ambientd before the agent runs:\n%s", runtimeConfig(t))
	}
	if err := node.ImportImage(ctx, agentImageArchive(t)); err != nil {
		t.Fatal(err)
	}
	r.overlay = overlay(t, nodeenv.AgentTag)
	start := time.Now()
	if out, err := node.Kubectl(ctx, "apply", "-k", r.overlay); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("kubectl apply -k:\n%s", out)
	}
	// The plugin is installed and the agent answers /readyz: not ready, the
	// ztunnel is missing.
	var body string
	if err := nodeenv.Poll(ctx, "agent installs the plugin and serves /readyz", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		if !pluginInstalled(t) {
			return false, fmt.Errorf("plugin not in the runtime's CNI config yet")
		}
		code, b, err := nodeenv.AgentReadyz(ctx)
		body = b
		return err == nil && code != 0, err
	}); err != nil {
		p, _ := node.AgentPod(context.Background())
		t.Fatalf("%v; agent pod: %s", err, describe(p))
	}
	installed := time.Since(start)
	code, body, err := nodeenv.AgentReadyz(ctx)
	if err != nil || code == http.StatusOK {
		t.Fatalf("agent /readyz without a ztunnel: %d %v\n%s", code, err, body)
	}
	t.Logf("apply -> plugin installed, /readyz answering: %s; /readyz without ztunnel: %d\n%s", installed.Round(time.Millisecond), code, body)
	// Kubelet ran the readiness probe against that: the pod is not Ready and
	// the taint stays. Wait for the probe to have run at least once.
	if err := nodeenv.Poll(ctx, "agent pod running, probed not ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		if err != nil || p == nil || p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) == 0 {
			return false, err
		}
		if podReady(p) {
			return false, fmt.Errorf("agent pod Ready without a ztunnel: %s", describe(p))
		}
		return p.Status.ContainerStatuses[0].Started != nil && *p.Status.ContainerStatuses[0].Started, nil
	}); err != nil {
		t.Fatal(err)
	}
	if tainted, err := nodeTainted(ctx); err != nil || !tainted {
		t.Fatalf("startup taint removed before ztunnel connected: tainted=%v %v", tainted, err)
	}

	emStart := time.Now()
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	var readyAt, untaintedAt time.Duration
	if err := nodeenv.Poll(ctx, "DaemonSet Ready and taint removed after ztunnel connected", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		ds, err := node.Env.CP.Admin.AppsV1().DaemonSets("istio-system").Get(ctx, "ambientd", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if readyAt == 0 && ds.Status.NumberReady == 1 {
			readyAt = time.Since(emStart)
		}
		tainted, err := nodeTainted(ctx)
		if err != nil {
			return false, err
		}
		if untaintedAt == 0 && !tainted {
			untaintedAt = time.Since(emStart)
		}
		return readyAt != 0 && untaintedAt != 0, nil
	}); err != nil {
		t.Fatal(err)
	}
	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil || !st.Connected {
		t.Fatalf("emulator state: connected=%v %v", st.Connected, err)
	}
	t.Logf("ztunnel emulator started -> DaemonSet 1/1 Ready: %s, startup taint removed: %s (apply -> Ready %s)",
		readyAt.Round(time.Millisecond), untaintedAt.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}
