//go:build e2enode

package e2eswitch

import (
	"context"
	"net/http"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// stepTimeout bounds each wait of a scenario (the machine may be busy).
const stepTimeout = 3 * time.Minute

// scenario is one way of running the two agents.
type scenario struct {
	name string
	// istio is how Istio's agent is deployed (its chart's rule backend).
	istio nodeenv.IstioAgentVariant
	// env is ambientd's settings beyond deploy/'s ConfigMap: the handover
	// (docs/install.md, "Switching") and, in some scenarios, its backend.
	env map[string]string
	// ambientd is the backend ambientd's rules must be in while it runs.
	ambientd string
}

var scenarios = []scenario{
	// Istio's chart defaults (iptables; its start-up detection picks the
	// variant) and ambientd's defaults (native nftables): every switch
	// moves the rules to another backend.
	{name: "IstioIPTables", istio: nodeenv.IstioIPTables,
		env: map[string]string{"AMBIENTD_HANDOVER": "istio"}, ambientd: backendNFTables},
	// Istio's native nftables mode, ambientd pinned to iptables-nft: the
	// same moves, the other way round.
	{name: "IstioNFTables", istio: nodeenv.IstioNFTables,
		env: map[string]string{"AMBIENTD_HANDOVER": "istio-nftables", "AMBIENTD_IPTABLES": "nft"}, ambientd: backendNFT},
	// Istio's native nftables mode and ambientd's defaults: both use Istio's
	// nftables layout, each adopts the other's tables in place.
	{name: "IstioNFTablesAmbientdDefault", istio: nodeenv.IstioNFTables,
		env: map[string]string{"AMBIENTD_HANDOVER": "istio-nftables"}, ambientd: backendNFTables},
}

// TestSwitch runs, for each scenario, Istio → ambientd → Istio on the live
// node with two pods enrolled by Istio and one by ambientd in between. At
// every step each pod has exactly one backend's capture rules (the jumps
// from each built-in chain counted in iptables-legacy, iptables-nft and
// nftables); each pod's outbound connection, sampled every 200 ms from
// start to end, always lands on ztunnel (never direct, never black-holed);
// no pod's `enabled` annotation is ever removed; after the switch back,
// Istio's agent has every pod in its ztunnel snapshot, and when it takes one
// out of the mesh that pod's traffic goes direct and no capture rule is left
// in it.
func TestSwitch(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 25*time.Minute)
	for _, archive := range []func() (string, error){node.AgentImageArchive, node.IstioAgentImageArchive} {
		p, err := archive()
		if err != nil {
			t.Fatal(err)
		}
		if err := node.ImportImage(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	node.RestoredAtCleanup(t, ctx, "the switch tests")
	em, err := node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = em.Stop(10 * time.Second) })
	p := startPeer(t)
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			r := &run{t: t, sc: sc, em: em, peer: p, samplers: map[string]*sampler{}}
			r.scenario(ctx)
		})
	}
}

// run is one scenario's state.
type run struct {
	t        *testing.T
	sc       scenario
	em       *e2eenv.Emulator
	peer     *peer
	ns       string
	istio    string // Istio's kustomization dir
	ambientd string // ambientd's
	samplers map[string]*sampler
	netns    map[string]string
	uids     map[string]string
}

func (r *run) scenario(ctx context.Context) {
	t := r.t
	r.netns, r.uids = map[string]string{}, map[string]string{}
	var err error
	if r.istio, err = node.WriteIstioAgentOverlay(t.TempDir(), r.sc.istio); err != nil {
		t.Fatal(err)
	}
	if r.ambientd, err = node.WriteAgentOverlayEnv(t.TempDir(), nodeenv.AgentTag, r.sc.env); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.removeAgents)
	r.ns = strings.ToLower("switch-" + r.sc.name)
	if _, err := node.Env.CreateNamespace(ctx, r.ns, map[string]string{podmeta.LabelDataplaneMode: "ambient"}); err != nil {
		t.Fatal(err)
	}
	// The pods go before the agents (cleanups run last first): their CNI
	// DEL reaches the agent that enrolled them.
	t.Cleanup(func() { r.deleteNamespace() })
	annotations := watchAnnotations(t, r.ns)
	t.Cleanup(r.diagnostics) // first of the cleanups: the pods and agents are still there

	// 1. Istio's agent enrolls a and b.
	start := time.Now()
	r.deployIstio(ctx)
	r.step(ctx, "Istio's agent started")
	for _, name := range []string{"a", "b"} {
		r.startPod(ctx, name)
	}
	istio1 := r.step(ctx, "Istio enrolled a and b")
	t.Logf("Istio's agent put the rules in %s", istio1)

	// 2. Istio → ambientd: Istio's DaemonSet leaves the node (its agent
	// uninstalls: plugin, host rules; the pods keep their rules), then
	// ambientd's is applied and adopts the pods.
	r.kubectl(ctx, "-n", "istio-system", "delete", "daemonset", nodeenv.IstioAgentDaemonSet, "--cascade=foreground")
	r.waitGone(ctx, "Istio's agent pod", node.IstioAgentPod)
	if got := r.step(ctx, "Istio's agent gone, pods keep its rules"); got != istio1 {
		t.Errorf("with no agent running the pods' rules moved from %s to %s", istio1, got)
	}
	r.kubectl(ctx, "apply", "-k", r.ambientd)
	r.poll(ctx, "ambientd ready", func(ctx context.Context) (bool, error) {
		code, _, err := nodeenv.AgentReadyz(ctx)
		return err == nil && code == http.StatusOK, err
	})
	r.waitSnapshot(ctx, "ambientd", "a", "b")
	if got := r.step(ctx, "ambientd adopted a and b"); got != r.sc.ambientd {
		t.Errorf("ambientd runs with the pods' rules in %s, want %s", got, r.sc.ambientd)
	}

	// 3. ambientd enrolls c.
	r.startPod(ctx, "c")
	r.step(ctx, "ambientd enrolled c")

	// 4. ambientd → Istio: the documented uninstall (the handover is in the
	// agent's settings), then Istio's DaemonSet again.
	agentLog := r.followAgentLog(ctx)
	r.kubectl(ctx, "delete", "-k", r.ambientd, "--cascade=foreground")
	r.waitGone(ctx, "ambientd's agent pod", node.AgentPod)
	for _, line := range agentLog() {
		if strings.Contains(line, "handover") || strings.Contains(line, "handing") || strings.Contains(line, "uninstall") || strings.Contains(line, "Istio's agent will use") {
			t.Logf("ambientd: %s", line)
		}
	}
	handedOver := r.step(ctx, "ambientd handed over and is gone")
	r.deployIstio(ctx)
	r.waitSnapshot(ctx, "Istio's agent", "a", "b", "c")
	istio2 := r.step(ctx, "Istio's agent took a, b and c over")
	if istio2 != handedOver {
		t.Errorf("ambientd handed the pods over in %s, Istio's agent uses %s", handedOver, istio2)
	}
	t.Logf("handed over in %s; Istio's agent uses %s (it used %s at its first start)", handedOver, istio2, istio1)

	// 5. Istio takes b out of the mesh: its traffic goes direct and nothing
	// of any capture is left in it.
	unlabelled := time.Now()
	r.kubectl(ctx, "-n", r.ns, "label", "pod", "b", podmeta.LabelDataplaneMode+"=none", "--overwrite")
	// Istio's agent deletes its rules in the pod, then tells ztunnel.
	r.waitEmu(ctx, "Istio's Del of b", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Requests, func(q ztunnelemu.RequestRecord) bool {
			return q.Op == "del" && q.UID == r.uids["b"] && q.At.After(unlabelled)
		})
	})
	released := time.Now()
	if j, err := readJumps(ctx, r.netns["b"]); err != nil || len(j.backends()) != 0 {
		t.Errorf("pod b, out of the mesh and out of ztunnel, still has capture rules no agent owns: %s (%v)", j, err)
	}
	time.Sleep(2 * time.Second) // ten more samples of every pod
	for _, name := range []string{"a", "c"} {
		if _, err := r.jumps(ctx, name); err != nil {
			t.Errorf("pod %s after b left the mesh: %v", name, err)
		}
	}
	for _, s := range r.samplers {
		s.Stop()
	}

	// Every sample of a and c, and of b until Istio was told to take it
	// out, went through ztunnel; b's went direct once its rules were gone;
	// none failed.
	for name, s := range r.samplers {
		to := time.Time{}
		if name == "b" {
			to = unlabelled
		}
		n, bad := s.check(captured, start, to)
		t.Logf("pod %s: %d samples while enrolled, results %v", name, n, s.counts())
		if n == 0 {
			t.Errorf("pod %s: no samples", name)
		}
		for _, x := range bad {
			t.Errorf("pod %s at %s: outbound %s (%s), want it through ztunnel", name, x.at.Format("15:04:05.000"), x.result, x.detail)
		}
	}
	n, bad := r.samplers["b"].check(direct, released, time.Time{})
	if n < 5 {
		t.Errorf("pod b: %d samples after Istio took it out of the mesh, want at least 5", n)
	}
	for _, x := range bad {
		t.Errorf("pod b at %s, out of the mesh: outbound %s (%s), want direct", x.at.Format("15:04:05.000"), x.result, x.detail)
	}
	_, bad = r.samplers["b"].check(failed, unlabelled, released)
	for _, x := range bad {
		if x.result == failed {
			t.Errorf("pod b at %s, leaving the mesh: outbound failed (%s)", x.at.Format("15:04:05.000"), x.detail)
		}
	}
	if ch := annotations.Changes("b"); len(ch) > 0 {
		t.Errorf("the %s annotation changed from enabled on pods that stayed in the mesh:\n%s", podmeta.AnnotationRedirection, strings.Join(ch, "\n"))
	}
}

// step checks every pod started so far: exactly one backend's capture rules
// (none counted twice); it returns that backend, the same for every pod.
func (r *run) step(ctx context.Context, what string) string {
	r.t.Helper()
	var names []string
	for name := range r.netns {
		names = append(names, name)
	}
	slices.Sort(names)
	backend := ""
	var line []string
	for _, name := range names {
		b, err := r.jumps(ctx, name)
		if err != nil {
			r.t.Errorf("%s: pod %s: %v", what, name, err)
		}
		line = append(line, name+"="+b)
		if backend == "" {
			backend = b
		} else if b != backend {
			r.t.Errorf("%s: pods' rules in different backends: %v", what, line)
		}
	}
	r.t.Logf("%s: %s", what, strings.Join(line, " "))
	return backend
}

func (r *run) jumps(ctx context.Context, name string) (string, error) {
	j, err := readJumps(ctx, r.netns[name])
	if err != nil {
		return "", err
	}
	return j.oneSet()
}

// startPod creates an app pod, waits until it runs, is annotated enabled and
// is in ztunnel's workloads, and samples its outbound traffic from then on.
func (r *run) startPod(ctx context.Context, name string) {
	t := r.t
	sctx := ctx // the sampler runs until the scenario ends
	ctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	if _, err := node.Env.CP.Admin.CoreV1().Pods(r.ns).Create(ctx, nodeenv.AppPod(name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := node.WaitPod(ctx, r.ns, name, func(p *corev1.Pod) bool {
		return nodeenv.PodReady(p) && p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled
	})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(p.UID)
	r.waitEmu(ctx, "workload "+name, func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	path, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
	if err != nil {
		t.Fatal(err)
	}
	r.netns[name], r.uids[name] = path, uid
	r.samplers[name] = startSampler(sctx, name, path, r.peer.Addr)
}

// deployIstio applies Istio's agent and waits until its pod is Ready.
func (r *run) deployIstio(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	r.kubectl(ctx, "apply", "-k", r.istio)
	if err := nodeenv.Poll(ctx, "Istio's agent Ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.IstioAgentPod(ctx)
		return nodeenv.PodReady(p), err
	}); err != nil {
		p, _ := node.IstioAgentPod(ctx)
		r.t.Fatalf("%v: %s", err, nodeenv.Describe(p))
	}
}

// waitSnapshot waits until the newest ztunnel connection (the agent named who)
// has sent its snapshot and it holds the pods.
func (r *run) waitSnapshot(ctx context.Context, who string, pods ...string) {
	r.waitEmu(ctx, who+"'s ztunnel snapshot with "+strings.Join(pods, ", "), func(s ztunnelemu.State) bool {
		c, ok := s.Conn(s.CurrentConn)
		if !ok || !c.SnapshotSent {
			return false
		}
		for _, name := range pods {
			if !slices.ContainsFunc(c.Snapshot, func(i ztunnelemu.SnapshotItem) bool { return i.UID == r.uids[name] && i.Op == "add" }) {
				return false
			}
		}
		return true
	})
}

func (r *run) waitEmu(ctx context.Context, what string, cond func(ztunnelemu.State) bool) ztunnelemu.State {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	var st ztunnelemu.State
	if err := nodeenv.Poll(ctx, what, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		st = ztunnelemu.State{}
		if err := r.em.State(ctx, &st); err != nil {
			return false, err
		}
		return cond(st), nil
	}); err != nil {
		r.t.Fatal(err)
	}
	return st
}

// followAgentLog follows the log of ambientd's pod until it ends; the
// function returned waits for that end and returns the lines.
func (r *run) followAgentLog(ctx context.Context) func() []string {
	p, err := node.AgentPod(ctx)
	if err != nil || p == nil {
		r.t.Fatalf("ambientd's pod: %v", err)
	}
	var out strings.Builder
	cmd := exec.CommandContext(ctx, node.Bins.Kubectl, "--kubeconfig="+node.Env.CP.AdminKubeconfig, "logs", "-f", "-n", "istio-system", p.Name)
	cmd.Stdout = &out
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	return func() []string {
		_ = cmd.Wait()
		return strings.Split(strings.TrimSpace(out.String()), "\n")
	}
}

// poll waits, at most stepTimeout, for cond (checked every 100 ms).
func (r *run) poll(ctx context.Context, what string, cond func(context.Context) (bool, error)) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	if err := nodeenv.Poll(ctx, what, 100*time.Millisecond, cond); err != nil {
		r.t.Fatal(err)
	}
}

func (r *run) waitGone(ctx context.Context, what string, get func(context.Context) (*corev1.Pod, error)) {
	ctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	if err := nodeenv.Poll(ctx, what+" gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := get(ctx)
		return p == nil, err
	}); err != nil {
		r.t.Fatal(err)
	}
}

func (r *run) kubectl(ctx context.Context, args ...string) {
	r.t.Helper()
	start := time.Now()
	out, err := node.Kubectl(ctx, args...)
	r.t.Logf("kubectl %s (%s): %s", strings.Join(args, " "), time.Since(start).Round(time.Millisecond), strings.TrimSpace(out))
	if err != nil {
		r.t.Fatal(err)
	}
}

// removeAgents deletes whatever of both agents is left, waiting for their
// pods (each agent uninstalls from the node as it stops).
func (r *run) removeAgents() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, s := range r.samplers {
		s.Stop()
	}
	for _, dir := range []string{r.ambientd, r.istio} {
		if out, err := node.Kubectl(ctx, "delete", "-k", dir, "--ignore-not-found", "--cascade=foreground"); err != nil {
			r.t.Errorf("cleanup: kubectl delete -k %s: %v: %s", dir, err, out)
		}
	}
	for what, get := range map[string]func(context.Context) (*corev1.Pod, error){"ambientd": node.AgentPod, "Istio's agent": node.IstioAgentPod} {
		if err := nodeenv.Poll(ctx, what+" pod gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
			p, err := get(ctx)
			return p == nil, err
		}); err != nil {
			r.t.Errorf("cleanup: %v", err)
		}
	}
}

// deleteNamespace deletes the scenario's namespace and waits until it is
// gone (its pods deleted through the CNI chain).
func (r *run) deleteNamespace() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := node.Env.CP.Admin
	_ = admin.CoreV1().Namespaces().Delete(ctx, r.ns, metav1.DeleteOptions{})
	if err := nodeenv.Poll(ctx, "namespace "+r.ns+" gone", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := admin.CoreV1().Namespaces().Get(ctx, r.ns, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		r.t.Errorf("cleanup: %v", err)
	}
}

// diagnostics prints, when the scenario failed, both agents' logs, the
// node's rules and every pod's.
func (r *run) diagnostics() {
	t := r.t
	if !t.Failed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, ds := range []string{"ambientd", nodeenv.IstioAgentDaemonSet} {
		logs, err := node.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/"+ds, "--tail=300")
		t.Logf("%s log (%v):\n%s", ds, err, logs)
	}
	for _, args := range [][]string{{"iptables-legacy-save"}, {"iptables-nft-save"}, {"ipset", "list", "-n"}, {"nft", "list", "ruleset"}} {
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		t.Logf("node: %s (%v):\n%s", strings.Join(args, " "), err, out)
	}
	for name, path := range r.netns {
		j, err := readJumps(ctx, path)
		t.Logf("pod %s (%s): jumps %s %v (%v)", name, path, j, j, err)
	}
}
