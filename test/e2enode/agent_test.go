//go:build e2enode

package e2enode

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	criv1 "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// overlay writes the agent's kustomize overlay (nodeenv.WriteAgentOverlay)
// into a temp dir and returns it.
func overlay(t *testing.T, tag string) string {
	t.Helper()
	dir, err := node.WriteAgentOverlay(t.TempDir(), tag)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func agentImageArchive(t *testing.T) string {
	t.Helper()
	p, err := node.AgentImageArchive()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func conflist(t *testing.T) string {
	t.Helper()
	s, err := node.ConflistText()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// pluginInstalled reports whether the agent's plugin is in the CNI config
// containerd uses (the agent's own conflist or the primary's file).
func pluginInstalled(t *testing.T) bool {
	t.Helper()
	ok, err := node.PluginInstalled()
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// runtimeConfig is the name and text of the CNI config containerd uses.
func runtimeConfig(t *testing.T) string {
	t.Helper()
	name, text, err := node.RuntimeConfig()
	if err != nil {
		t.Fatal(err)
	}
	return name + ":\n" + text
}

// agentCNISocket is where the plugin reaches the agent (deploy/'s ConfigMap).
const agentCNISocket = "/run/ambientd/cni.sock"

// waitCNIUnserved waits until nothing answers on agentCNISocket: the old
// agent of a roll has stopped serving CNI (and the new one does not yet).
func waitCNIUnserved(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := nodeenv.Poll(ctx, "the old agent stops serving CNI", 20*time.Millisecond, func(ctx context.Context) (bool, error) {
		c, err := net.DialTimeout("unix", agentCNISocket, 100*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err != nil, nil
	}); err != nil {
		t.Fatal(err)
	}
}

func nodeTainted(ctx context.Context) (bool, error) { return node.Tainted(ctx, startupTaint) }

// agentRun is the agent's DaemonSet on the node and the ztunnel emulator.
type agentRun struct {
	overlay  string
	em       *e2eenv.Emulator
	pristine pristineNode // the node before the first install
}

// TestAgentOnRealNode runs ambientd's own DaemonSet (deploy/ through a test
// overlay, the image `make image` built) on the node, with the ztunnel
// emulator at the node's ztunnel socket, and kubelet-created pods in an
// ambient namespace. The subtests share the DaemonSet and run in order.
func TestAgentOnRealNode(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 15*time.Minute)
	// Last: the steps' namespaces are deleted asynchronously; the node is
	// back to its state before (no pod netns, lease, task, shim or cgroup
	// left) before the next test looks at it.
	node.RestoredAtCleanup(t, ctx, "the agent tests")
	r := &agentRun{pristine: readPristine(t)}
	t.Cleanup(func() { r.remove(t) })
	steps := []struct {
		name string
		fn   func(*testing.T, context.Context)
	}{
		{"DaemonSetReadyOnlyAfterZtunnel", r.daemonSetReadyOnlyAfterZtunnel},
		{"AmbientPodEnrolledCapturedReady", r.ambientPodEnrolledCapturedReady},
		{"SidecarPodCapturedValidated", r.sidecarPodCapturedValidated},
		{"SidecarSkipCases", r.sidecarSkipCases},
		{"SidecarPodWithoutPluginRepaired", r.sidecarPodWithoutPluginRepaired},
		{"SidecarNamespaceMigratesToAmbient", r.sidecarNamespaceMigratesToAmbient},
		{"SidecarBrokenPodDeleted", r.sidecarBrokenPodDeleted},
		{"GatedPodNotReadyWithoutZtunnel", r.gatedPodNotReadyWithoutZtunnel},
		{"ZtunnelGoneDropsEndpoints", r.ztunnelGoneDropsEndpoints},
		{"AdmissionGatesFromPolicy", r.admissionGatesFromPolicy},
		{"StartupCost", r.startupCost},
		{"SandboxRecreatedStaysEnrolled", r.sandboxRecreatedStaysEnrolled},
		{"StaticPods", r.staticPods},
		{"ContainersRestartStayEnrolled", r.containersRestartStayEnrolled},
		{"HostNetworkPodNeverAPod", r.hostNetworkPodNeverAPod},
		{"RollingUpdateKeepsCapture", r.rollingUpdateKeepsCapture},
		{"AgentPodForceDeletedKeepsPlugin", r.agentPodForceDeletedKeepsPlugin},
		{"ImageThatCannotBePulled", r.imageThatCannotBePulled},
		{"MultusOnTheNode", r.multusOnTheNode},
		{"NodeRebootCapturesBeforeReady", r.nodeRebootCapturesBeforeReady},
		{"UninstallInterruptedBySIGKILLRecovers", r.uninstallInterruptedBySIGKILLRecovers},
		{"UninstallInterruptedByRebootRecovers", r.uninstallInterruptedByRebootRecovers},
		{"UninstallLeavesNodeAsBefore", r.uninstallLeavesNodeAsBefore},
	}
	for _, s := range steps {
		if !t.Run(s.name, func(t *testing.T) {
			t.Cleanup(func() { agentDiagnostics(t) })
			ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
			defer cancel()
			s.fn(t, ctx)
		}) {
			return
		}
	}
}

// agentDiagnostics prints, when t failed, the agent's log and the node's
// host rules (the agent runs in the host network: the node netns).
func agentDiagnostics(t *testing.T) {
	if !t.Failed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	logs, err := node.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/ambientd", "--tail=200")
	t.Logf("agent log (%v):\n%s", err, logs)
	for _, args := range [][]string{{"iptables-save"}, {"ipset", "list"}, {"nft", "list", "ruleset"}} {
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		t.Logf("node netns: %s (%v):\n%s", strings.Join(args, " "), err, out)
	}
	if entries, err := os.ReadDir(node.NetnsDir); err == nil {
		for _, e := range entries {
			out, err := exec.CommandContext(ctx, "ip", "netns", "exec", e.Name(), "nft", "list", "ruleset").CombinedOutput()
			t.Logf("pod netns %s: nft list ruleset (%v):\n%s", e.Name(), err, out)
		}
	}
}

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

// remove deletes the DaemonSet (the agent then uninstalls its plugin: the
// DaemonSet is gone) and stops the emulator.
func (r *agentRun) remove(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if r.overlay != "" {
		err := node.Env.CP.Admin.AppsV1().DaemonSets("istio-system").Delete(ctx, "ambientd", metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete DaemonSet: %v", err)
		}
		if err := nodeenv.Poll(ctx, "agent pod gone and plugin uninstalled", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
			p, err := node.AgentPod(ctx)
			return p == nil && !pluginInstalled(t), err
		}); err != nil {
			t.Errorf("%v; runtime's CNI config %s", err, runtimeConfig(t))
		}
		// A step failed before the uninstall step: the install's
		// cluster-scoped objects (admission policies, RBAC) go too, or the
		// next test's install finds them owned by another field manager.
		if r.overlay != "helm" {
			if out, err := node.Kubectl(ctx, "delete", "-k", overlay(t, nodeenv.AgentTag), "--ignore-not-found"); err != nil {
				t.Errorf("kubectl delete -k: %v: %s", err, out)
			}
		}
	}
	if r.em != nil {
		if err := r.em.Stop(5 * time.Second); err != nil {
			t.Logf("emulator stop: %v", err)
		}
	}
}

// ambientNamespace creates a namespace labelled for ambient.
func ambientNamespace(t *testing.T, ctx context.Context, name string) string {
	t.Helper()
	if _, err := node.Env.CreateNamespace(ctx, name, map[string]string{podmeta.LabelDataplaneMode: "ambient"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = node.Env.CP.Admin.CoreV1().Namespaces().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// newNetns returns the netns in after that is not in before (exactly one).
func newNetns(t *testing.T, before, after nodeenv.State) string {
	t.Helper()
	var added []string
	for _, n := range after.Netns {
		if !slices.Contains(before.Netns, n) {
			added = append(added, n)
		}
	}
	if len(added) != 1 {
		t.Fatalf("netns before %v, after %v: want exactly one more", before.Netns, after.Netns)
	}
	return filepath.Join(node.NetnsDir, added[0])
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	h, err := podnetns.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	return h.Inode()
}

func (r *agentRun) waitEmu(t *testing.T, ctx context.Context, what string, cond func(ztunnelemu.State) bool) ztunnelemu.State {
	t.Helper()
	var st ztunnelemu.State
	if err := nodeenv.Poll(ctx, "emulator: "+what, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		st = ztunnelemu.State{}
		if err := r.em.State(ctx, &st); err != nil {
			return false, err
		}
		return cond(st), nil
	}); err != nil {
		t.Fatalf("%v; requests: %+v", err, st.Requests)
	}
	return st
}

// ambientPodEnrolledCapturedReady: a kubelet-created pod in an ambient
// namespace, with the enrolled readiness gate, is handed to ztunnel with its
// netns (the one containerd made), annotated enabled, captured both ways
// (its outbound connection lands on ztunnel's 15001, an inbound one on
// 15006), Ready only once ztunnel acked, and kubelet's HTTP probes keep
// passing through the probe SNAT. Then it is deleted by kubelet: ztunnel
// gets one Del, and containerd's repeated DEL (empty netns) changes nothing.
func (r *agentRun) ambientPodEnrolledCapturedReady(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-app")
	workload := ns + "/web"
	// While ztunnel refuses the Add, the gate keeps the pod not Ready.
	if err := r.em.SetNack(ctx, workload, "refused by the test"); err != nil {
		t.Fatal(err)
	}
	before, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("web"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	r.waitEmu(t, ctx, "a refused Add for "+workload, func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Requests, func(q ztunnelemu.RequestRecord) bool {
			return q.UID == uid && q.Op == "add" && q.AckError != ""
		})
	})
	// The agent recorded the refusal on the pod (pending; not Ready: the
	// gate holds it, while kubelet's probes pass through the probe SNAT).
	p, err := waitPod(ctx, ns, "web", func(p *corev1.Pod) bool {
		c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
		return p.Status.Phase == corev1.PodRunning && c != nil && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, "refused by the test")
	})
	if err != nil {
		t.Fatal(err)
	}
	if podReady(p) {
		t.Fatalf("pod Ready while ztunnel refuses it: %s", describe(p))
	}
	t.Logf("while refused: %s", describe(p))
	if err := r.em.ClearNack(ctx, workload); err != nil {
		t.Fatal(err)
	}
	p, err = waitPod(ctx, ns, "web", podReady)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod create -> Ready (first Add refused, then acked on the agent's retry): %s", time.Since(start).Round(time.Millisecond))
	if got := p.Annotations[podmeta.AnnotationRedirection]; got != "enabled" {
		t.Errorf("annotation %s = %q, want enabled", podmeta.AnnotationRedirection, got)
	}
	if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c == nil || c.Status != corev1.ConditionTrue {
		t.Errorf("condition %s: %+v, want True", nodeenv.EnrolledCondition, c)
	}

	after, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	netnsPath := newNetns(t, before, after)
	st := r.waitEmu(t, ctx, "workload "+uid, func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	w, _ := st.Workload(uid)
	if want := inode(t, netnsPath); w.NetnsInode != want {
		t.Errorf("ztunnel got netns inode %d, containerd's netns %s is %d", w.NetnsInode, netnsPath, want)
	}
	if w.Name != "web" || w.Namespace != ns {
		t.Errorf("ztunnel workload %+v: want %s", w, workload)
	}

	// Captured: outbound from the pod to the node's address lands on 15001
	// (the original destination preserved); inbound from another pod to the
	// app's port lands on 15006. (A connection from the node itself counts
	// as a probe: the host rules SNAT it past the capture, as kubelet's.)
	podIP := netip.MustParseAddr(p.Status.PodIP)
	outDst := netip.AddrPortFrom(node.IP, 9).String()
	dialFrom(t, ctx, netnsPath, outDst)
	clientNetns := plainClient(t, ctx)
	inDst := netip.AddrPortFrom(podIP, nodeenv.AppPort).String()
	dialFrom(t, ctx, clientNetns, inDst)
	st = r.waitEmu(t, ctx, "outbound and inbound connections accepted", func(s ztunnelemu.State) bool {
		out := slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
		in := slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15006 })
		return out && in
	})
	for _, a := range st.Accepted {
		if a.UID != uid {
			continue
		}
		if (a.Port == 15001 && a.OrigDst != outDst) || (a.Port == 15006 && a.OrigDst != inDst) {
			t.Errorf("accepted %+v: original destination should be %s (outbound) or %s (inbound)", a, outDst, inDst)
		}
	}

	// Kubelet's probes reach the app itself, from the probe SNAT address,
	// and keep passing: the pod stays Ready and the app logs new probes.
	probes := func() int {
		logs, err := node.Kubectl(ctx, "logs", "-n", ns, "web")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(logs, "probe /healthz from 169.254.7.127:")
	}
	n0 := probes()
	if err := nodeenv.Poll(ctx, "more probes through the SNAT", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		return probes() >= n0+3, nil
	}); err != nil {
		logs, _ := node.Kubectl(ctx, "logs", "-n", ns, "web")
		t.Fatalf("%v; app log:\n%s", err, logs)
	}
	if p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{}); err != nil || !podReady(p) {
		t.Fatalf("pod no longer Ready after probes: %s %v", describe(p), err)
	}

	// Deleted by kubelet: one Del to ztunnel; the netns is gone; containerd's
	// second DEL (empty CNI_NETNS) produced no second Del and no error.
	if err := node.Env.CP.Admin.CoreV1().Pods(ns).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "pod gone from the API, its netns from the node", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			return false, nil
		}
		_, err = os.Stat(netnsPath)
		return os.IsNotExist(err), nil
	}); err != nil {
		t.Fatal(err)
	}
	st = r.waitEmu(t, ctx, "Del for "+uid, func(s ztunnelemu.State) bool {
		_, present := s.Workload(uid)
		return !present && slices.ContainsFunc(s.Requests, func(q ztunnelemu.RequestRecord) bool { return q.UID == uid && q.Op == "del" })
	})
	dels := 0
	for _, q := range st.Requests {
		if q.UID == uid && q.Op == "del" {
			dels++
		}
	}
	if dels != 1 {
		t.Errorf("ztunnel got %d Dels for the pod, want 1", dels)
	}
	if strings.Contains(strings.ToLower(node.Containerd.Logs()), "failed to destroy network") {
		t.Errorf("containerd failed a CNI DEL:\n%s", node.Containerd.LogTail(40))
	}
}

// gatedPodNotReadyWithoutZtunnel: the negative. Without a ztunnel the agent
// cannot enroll (the CNI ADD succeeds, the pod waits `pending`), and a gated
// pod never turns Ready though its container is; once ztunnel is back it is
// enrolled and turns Ready.
func (r *agentRun) gatedPodNotReadyWithoutZtunnel(t *testing.T, ctx context.Context) {
	if err := r.em.Stop(5 * time.Second); err != nil {
		t.Logf("emulator stop: %v", err)
	}
	r.em = nil
	ns := ambientNamespace(t, ctx, "ambient-noztunnel")
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("gated"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := waitPod(ctx, ns, "gated", func(p *corev1.Pod) bool {
		c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
		return p.Status.Phase == corev1.PodRunning && p.Annotations[podmeta.AnnotationRedirection] != "" && c != nil && c.Status == corev1.ConditionFalse
	})
	if err != nil {
		t.Fatal(err)
	}
	if podReady(p) {
		t.Fatalf("gated pod Ready without ztunnel: %s", describe(p))
	}
	if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c != nil && c.Status == corev1.ConditionTrue {
		t.Fatalf("condition %s True without ztunnel: %+v", nodeenv.EnrolledCondition, c)
	}
	t.Logf("without ztunnel: annotation %q; %s", p.Annotations[podmeta.AnnotationRedirection], describe(p))
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := waitPod(ctx, ns, "gated", podReady); err != nil {
		t.Fatal(err)
	}
	t.Logf("ztunnel back -> gated pod Ready: %s", time.Since(start).Round(time.Millisecond))
}

// dialFrom opens (and closes) a TCP connection to dst from inside the
// network namespace at netnsPath.
func dialFrom(t *testing.T, ctx context.Context, netnsPath, dst string) {
	t.Helper()
	c, err := nodeenv.DialFrom(ctx, netnsPath, dst)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}

// plainClient starts a pod outside the mesh and returns its netns path.
func plainClient(t *testing.T, ctx context.Context) string {
	t.Helper()
	ns := namespace(t, ctx, "plain-client")
	_, netns := startPod(t, ctx, ns, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "client"}, Spec: appPodSpec()})
	return netns
}

// startPod creates pod in ns, waits until it is Ready and returns it with
// the path of the network namespace containerd made for it (pods are
// started one at a time: the one new netns).
func startPod(t *testing.T, ctx context.Context, ns string, pod *corev1.Pod) (*corev1.Pod, string) {
	t.Helper()
	before, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := waitPod(ctx, ns, pod.Name, podReady)
	if err != nil {
		t.Fatal(err)
	}
	after, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return p, newNetns(t, before, after)
}

// startupCost measures pod create -> Ready on this node for a pod outside
// the mesh and for an ambient pod with the readiness gate (same image and
// probe), one after the other. It prints numbers; it asserts only that both
// become Ready.
func (r *agentRun) startupCost(t *testing.T, ctx context.Context) {
	plain := namespace(t, ctx, "cost-plain")
	ambient := ambientNamespace(t, ctx, "cost-ambient")
	for i := range 3 {
		for _, c := range []struct {
			ns  string
			pod *corev1.Pod
		}{
			{plain, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app"}, Spec: appPodSpec()}},
			{ambient, nodeenv.GatedPod("app")},
		} {
			start := time.Now()
			if _, err := node.Env.CP.Admin.CoreV1().Pods(c.ns).Create(ctx, c.pod, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := waitPod(ctx, c.ns, "app", podReady); err != nil {
				t.Fatal(err)
			}
			t.Logf("run %d: %s pod create -> Ready: %s", i+1, c.ns, time.Since(start).Round(time.Millisecond))
			deletePodsAndWait(t, ctx, c.ns, metav1.ListOptions{FieldSelector: "metadata.name=app"})
		}
	}
}

// sandboxRecreatedStaysEnrolled: the pod's sandbox dies (its pause process
// is killed); kubelet stops it (CNI DEL with its netns), starts a new one
// (ADD with a new netns) and, in its garbage collection about a minute
// later, removes the dead one, for which containerd 1.6 runs CNI DEL again
// with an empty CNI_NETNS and the old sandbox's id but the same pod uid.
// The pod must end enrolled with the new netns, and stay so after that late
// DEL: no Del to ztunnel after the last Add.
func (r *agentRun) sandboxRecreatedStaysEnrolled(t *testing.T, ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	ns := ambientNamespace(t, ctx, "ambient-retry")
	created, oldNetns := startPod(t, ctx, ns, nodeenv.GatedPod("web"))
	uid := string(created.UID)
	oldInode := inode(t, oldNetns)
	pause := processIn(t, oldInode, "pause")
	var st0 ztunnelemu.State
	if err := r.em.State(ctx, &st0); err != nil {
		t.Fatal(err)
	}
	n0 := len(opsFor(st0, uid))
	killed := time.Now()
	if err := unixKill(pause); err != nil {
		t.Fatal(err)
	}
	// A new sandbox: ztunnel gets a Del and an Add again (with the new netns:
	// compared below by the path containerd made, since the kernel may give
	// the new netns the dead one's inode number), the pod Ready again.
	r.waitEmu(t, ctx, "Del and a new Add", func(s ztunnelemu.State) bool {
		ops := opsFor(s, uid)
		return len(ops) >= n0+2 && slices.Contains(ops[n0:], "del") && ops[len(ops)-1] == "add"
	})
	// Ready again in a new sandbox: the pod's reported IP is in a netns
	// that is not the old one (the status may still show the old IP for a
	// moment).
	var p *corev1.Pod
	var newNetns string
	if err := nodeenv.Poll(ctx, "pod Ready in its new sandbox", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		var err error
		if p, err = node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{}); err != nil || !podReady(p) {
			return false, err
		}
		newNetns, err = node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
		return err == nil && newNetns != oldNetns, err
	}); err != nil {
		t.Fatalf("%v; %s", err, describe(p))
	}
	t.Logf("pause killed -> pod Ready in a new sandbox: %s", time.Since(killed).Round(time.Millisecond))
	newInode := inode(t, newNetns)
	st := r.waitEmu(t, ctx, "the pod held with its new netns", func(s ztunnelemu.State) bool {
		w, ok := s.Workload(uid)
		return ok && w.NetnsInode == newInode
	})
	t.Logf("sandbox recreated: netns %s (inode %d) -> %s (inode %d); requests for the pod: %s", oldNetns, oldInode, newNetns, newInode, opsFor(st, uid))
	// kubelet's garbage collection removes a dead sandbox with
	// RemovePodSandbox once it holds no containers (with the default dead
	// container retention that is when the pod goes); make that same CRI call
	// now. containerd 1.6 then runs CNI DEL for the old sandbox again, with
	// an empty CNI_NETNS and the pod's uid.
	opsBefore := opsFor(st, uid)
	removeDeadSandboxes(t, ctx, uid)
	// The CNI DEL ran synchronously inside RemovePodSandbox, so the agent
	// answered it already.
	st = ztunnelemu.State{}
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	w, ok := st.Workload(uid)
	if !ok || w.NetnsInode != newInode {
		t.Errorf("after kubelet removed the dead sandbox, ztunnel has the pod: %v (%+v), want it with netns inode %d; requests: %s", ok, w, newInode, opsFor(st, uid))
	}
	// The agent answers a DEL after it told ztunnel, so a Del it sent for
	// this one is recorded by now.
	if ops := opsFor(st, uid); len(ops) != len(opsBefore) {
		t.Errorf("the dead sandbox's late DEL reached ztunnel: requests for the pod went from %v to %v (a live pod dropped and re-added)", opsBefore, ops)
	}
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("pod after the late DEL: %s, annotation %q (%v)", describe(p), p.Annotations[podmeta.AnnotationRedirection], err)
	}
}

// opsFor lists the ops (add, del, keep) ztunnel received for uid.
func opsFor(st ztunnelemu.State, uid string) []string {
	var ops []string
	for _, q := range st.Requests {
		if q.UID == uid {
			ops = append(ops, q.Op)
		}
	}
	return ops
}

// processIn finds the process named comm whose network namespace has the
// inode ino.
func processIn(t *testing.T, ino uint64, comm string) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if err != nil || strings.TrimSpace(string(c)) != comm {
			continue
		}
		if inodeOf(fmt.Sprintf("/proc/%d/ns/net", pid)) == ino {
			return pid
		}
	}
	t.Fatalf("no %s process in netns inode %d", comm, ino)
	return 0
}

func unixKill(pid int) error { return syscall.Kill(pid, syscall.SIGKILL) }

// removeDeadSandboxes removes the pod's not-ready sandboxes through
// containerd's CRI, as kubelet's garbage collection does, and returns when
// containerd answered.
func removeDeadSandboxes(t *testing.T, ctx context.Context, uid string) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+node.ContainerdAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rt := criv1.NewRuntimeServiceClient(conn)
	resp, err := rt.ListPodSandbox(ctx, &criv1.ListPodSandboxRequest{Filter: &criv1.PodSandboxFilter{
		State:         &criv1.PodSandboxStateValue{State: criv1.PodSandboxState_SANDBOX_NOTREADY},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": uid},
	}})
	if err != nil {
		t.Fatalf("CRI ListPodSandbox: %v", err)
	}
	if len(resp.Items) != 1 {
		t.Fatalf("pod %s has %d dead sandboxes, want 1: %v", uid, len(resp.Items), resp.Items)
	}
	for _, sb := range resp.Items {
		if _, err := rt.RemovePodSandbox(ctx, &criv1.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
			t.Fatalf("CRI RemovePodSandbox %s: %v", sb.Id, err)
		}
		t.Logf("removed dead sandbox %s through the CRI", sb.Id)
	}
}

// rollingUpdateKeepsCapture: the DaemonSet is updated to another image tag
// (the same image, retagged in containerd); kubelet replaces the agent's
// pod. An enrolled pod never gets a Del and stays Ready; a pod created right
// after the update started ends enrolled and Ready.
func (r *agentRun) rollingUpdateKeepsCapture(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-update")
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("before"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	if _, err := waitPod(ctx, ns, "before", podReady); err != nil {
		t.Fatal(err)
	}
	old, err := node.AgentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("agent pod: %v", err)
	}
	const newTag = "dev-update"
	out, err := exec.CommandContext(ctx, node.Bins.Ctr, "--address", node.ContainerdAddress, "--namespace", "k8s.io",
		"images", "tag", "--force", nodeenv.AgentImage+":"+nodeenv.AgentTag, nodeenv.AgentImage+":"+newTag).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images tag: %v: %s", err, out)
	}
	start := time.Now()
	if _, err := node.Kubectl(ctx, "apply", "-k", overlay(t, newTag)); err != nil {
		t.Fatal(err)
	}
	// A pod created while no agent serves the node (the old agent has
	// stopped answering on its CNI socket, the new one does not answer yet):
	// its sandbox must wait (the plugin fails the ADD, kubelet retries) and
	// start captured.
	waitCNIUnserved(t, ctx)
	gap := time.Now()
	t.Logf("apply new tag -> old agent stopped serving CNI: %s", gap.Sub(start).Round(time.Millisecond))
	during, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod("during"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "DaemonSet rolled to "+newTag, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		if err != nil || p == nil || p.UID == old.UID {
			return false, err
		}
		return p.Spec.Containers[0].Image == nodeenv.AgentImage+":"+newTag && podReady(p), nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("apply new tag -> new agent pod Ready: %s", time.Since(start).Round(time.Millisecond))
	duringPod, err := waitPod(ctx, ns, "during", podReady)
	if err != nil {
		t.Fatal(err)
	}
	r.capturedBeforeStart(t, ctx, duringPod)
	evs, err := node.Env.CP.Admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=during,reason=FailedCreatePodSandBox"})
	if err != nil {
		t.Fatal(err)
	}
	waited := 0
	for _, e := range evs.Items {
		if strings.Contains(e.Message, "ambientd agent unreachable") {
			waited += int(max(e.Count, 1))
		}
	}
	t.Logf("pod created in the gap: %d sandbox attempts refused while no agent served (kubelet retried), Ready %s after creation",
		waited, time.Since(gap).Round(time.Millisecond))
	r.keptThroughTheRoll(t, ctx, "the update", uid, string(during.UID))
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "before", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("enrolled pod after the update: %s (%v)", describe(p), err)
	}
	if !pluginInstalled(t) {
		t.Errorf("plugin gone from the runtime's CNI config after the update: %s", runtimeConfig(t))
	}
}

// netnsByInode returns the path under the node's netns dir of the network
// namespace with inode ino.
func netnsByInode(t *testing.T, ino uint64) string {
	t.Helper()
	entries, err := os.ReadDir(node.NetnsDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if p := filepath.Join(node.NetnsDir, e.Name()); inodeOf(p) == ino {
			return p
		}
	}
	t.Fatalf("no netns with inode %d in %s", ino, node.NetnsDir)
	return ""
}

// appStartedAt is when the app container of pod ns/name (its current
// container) logged that it listens, from containerd's log timestamps
// (`kubectl logs --timestamps`, nanoseconds).
func appStartedAt(t *testing.T, ctx context.Context, ns, name string) time.Time {
	t.Helper()
	logs, err := node.Kubectl(ctx, "logs", "-n", ns, name, "--timestamps")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(logs, "\n") {
		ts, rest, _ := strings.Cut(line, " ")
		if strings.Contains(rest, " listening on ") {
			at, err := time.Parse(time.RFC3339Nano, ts)
			if err != nil {
				t.Fatalf("log timestamp %q: %v", ts, err)
			}
			return at
		}
	}
	t.Fatalf("pod %s/%s: no 'listening on' line in its log:\n%s", ns, name, logs)
	return time.Time{}
}

// capturedBeforeStart checks that pod p never ran uncaptured: the agent had
// programmed the redirection in the netns its running sandbox has (found by
// the pod's IP) before its app container started — the agent's log line for
// that CNI ADD against the app's first log line, both by timestamp — and that
// now ztunnel holds the pod with that netns and its outbound traffic lands
// on ztunnel's 15001. It returns ztunnel's Add.
// keptThroughTheRoll: after an agent roll (what), ztunnel holds both the pod
// enrolled before it (uid) and the one created during it, the first never got
// a Del, and its outbound connection still lands on ztunnel's 15001.
func (r *agentRun) keptThroughTheRoll(t *testing.T, ctx context.Context, what, uid, duringUID string) {
	t.Helper()
	st := r.waitEmu(t, ctx, "both pods held by ztunnel after "+what, func(s ztunnelemu.State) bool {
		_, a := s.Workload(uid)
		_, b := s.Workload(duringUID)
		return a && b
	})
	if ops := opsFor(st, uid); slices.Contains(ops, "del") {
		t.Errorf("the enrolled pod got a Del during %s: %v", what, ops)
	}
	w, _ := st.Workload(uid)
	dialFrom(t, ctx, netnsByInode(t, w.NetnsInode), netip.AddrPortFrom(node.IP, 9).String())
	r.waitEmu(t, ctx, "outbound connection of the enrolled pod after "+what, func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
	})
}

func (r *agentRun) capturedBeforeStart(t *testing.T, ctx context.Context, p *corev1.Pod) ztunnelemu.RequestRecord {
	t.Helper()
	netnsPath, started, rulesAt, outcome := startedCaptured(t, ctx, p)
	ino := inode(t, netnsPath)
	uid := string(p.UID)
	st := r.waitEmu(t, ctx, "workload "+p.Name+" with netns inode "+strconv.FormatUint(ino, 10), func(s ztunnelemu.State) bool {
		w, ok := s.Workload(uid)
		return ok && w.NetnsInode == ino
	})
	var add ztunnelemu.RequestRecord
	for _, q := range st.Requests {
		if q.UID == uid && q.Op == "add" && q.NetnsInode == ino && q.AckError == "" {
			add = q
			break
		}
	}
	if add.At.IsZero() {
		t.Fatalf("pod %s: no acked Add with netns inode %d: %v", p.Name, ino, opsFor(st, uid))
	}
	dst := netip.AddrPortFrom(node.IP, 9).String()
	dialFrom(t, ctx, netnsPath, dst)
	r.waitEmu(t, ctx, "outbound connection of "+p.Name+" on 15001", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool {
			return a.UID == uid && a.Port == 15001 && a.OrigDst == dst && a.At.After(add.At)
		})
	})
	t.Logf("pod %s: CNI ADD answered (%s, rules in netns inode %d) %s before its app started; ztunnel's Add %s after the app started",
		p.Name, outcome, ino, started.Sub(rulesAt).Round(time.Millisecond), add.At.Sub(started).Round(time.Millisecond))
	return add
}

// startedCaptured checks that pod p's app started only after the agent had
// answered the CNI ADD that programmed the redirection in the netns its
// running sandbox has (found by the pod's IP): the agent's log line for that
// ADD against the app's first log line, both by timestamp. It returns that
// netns, when the app started, when the ADD was answered and its outcome.
func startedCaptured(t *testing.T, ctx context.Context, p *corev1.Pod) (netnsPath string, started, rulesAt time.Time, outcome string) {
	t.Helper()
	netnsPath, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
	if err != nil {
		t.Fatal(err)
	}
	started = appStartedAt(t, ctx, p.Namespace, p.Name)
	rulesAt, outcome = ruledAt(t, ctx, string(p.UID), netnsPath)
	if !rulesAt.Before(started) {
		t.Errorf("pod %s/%s: its app started at %s, before the agent answered the CNI ADD for its netns %s (%s at %s): it ran uncaptured",
			p.Namespace, p.Name, started.Format(time.RFC3339Nano), netnsPath, outcome, rulesAt.Format(time.RFC3339Nano))
	}
	return netnsPath, started, rulesAt, outcome
}

// ruledAt finds in the agent's log (JSON lines) the CNI ADD that enrolled
// pod uid with the netns at netnsPath ("enrolling new pod"), and returns when
// the agent answered it ("CNI ADD handled": its rules were in place then)
// and the outcome it answered.
func ruledAt(t *testing.T, ctx context.Context, uid, netnsPath string) (time.Time, string) {
	t.Helper()
	logs, err := node.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/ambientd")
	if err != nil {
		t.Fatal(err)
	}
	at, outcome, ok := ruledAtIn(logs, uid, netnsPath)
	if !ok {
		t.Fatalf("agent log: no answered CNI ADD enrolling pod %s with netns %s:\n%s", uid, netnsPath, logs)
	}
	return at, outcome
}

// ruledAtIn is ruledAt over agent logs already read (one agent's or
// several agents' in turn).
func ruledAtIn(logs, uid, netnsPath string) (time.Time, string, bool) {
	var rec struct {
		Time    time.Time `json:"time"`
		Msg     string    `json:"msg"`
		UID     string    `json:"uid"`
		Netns   string    `json:"netns"`
		Outcome string    `json:"outcome"`
	}
	enrolling := false
	for _, line := range strings.Split(logs, "\n") {
		rec.Msg, rec.UID, rec.Netns, rec.Outcome = "", "", "", ""
		if json.Unmarshal([]byte(line), &rec) != nil || rec.UID != uid {
			continue
		}
		switch {
		case rec.Msg == "enrolling new pod":
			enrolling = rec.Netns == netnsPath
		case rec.Msg == "CNI ADD handled" && enrolling:
			return rec.Time, rec.Outcome, true
		}
	}
	return time.Time{}, "", false
}

// readyWatch follows the pods of a namespace and records, per pod, the first
// time it turned Ready after the watch began having been not Ready (a stale
// Ready from before does not count), and calls check right then.
type readyWatch struct {
	mu       sync.Mutex
	notReady map[string]bool      // pod name → seen not Ready since the watch began
	readyAt  map[string]time.Time // pod name → first Ready after that
}

func watchReady(t *testing.T, ctx context.Context, ns string, check func(p *corev1.Pod)) *readyWatch {
	t.Helper()
	rw := &readyWatch{notReady: map[string]bool{}, readyAt: map[string]time.Time{}}
	observe := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			return
		}
		ready := podReady(p)
		rw.mu.Lock()
		first := ready && rw.notReady[p.Name] && rw.readyAt[p.Name].IsZero()
		if !ready {
			rw.notReady[p.Name] = true
		}
		if first {
			rw.readyAt[p.Name] = time.Now()
		}
		rw.mu.Unlock()
		if first {
			check(p)
		}
	}
	observePods(t, ctx, ns, observe)
	return rw
}

// observePods calls observe with every version of ns's pods, added or
// updated, until the test ends. An informer, not a bare watch: it lists and
// watches again if the apiserver ends a watch.
func observePods(t *testing.T, ctx context.Context, ns string, observe func(obj any)) {
	t.Helper()
	f := informers.NewSharedInformerFactoryWithOptions(node.Env.CP.Admin, 0, informers.WithNamespace(ns))
	inf := f.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    observe,
		UpdateFunc: func(_, obj any) { observe(obj) },
	}); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	t.Cleanup(func() { cancel(); f.Shutdown() })
	f.Start(wctx.Done())
	if !cache.WaitForCacheSync(wctx.Done(), inf.HasSynced) {
		t.Fatal("pod informer did not sync")
	}
}

func (rw *readyWatch) ready(name string) time.Time {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	return rw.readyAt[name]
}

// nodeRebootCapturesBeforeReady: the node loses power with ambient pods and a
// plain pod running, then boots (nodeenv PowerOff/PowerOn: kubelet,
// containerd, every container and the agent killed; netns, /run, firewall and
// bridge gone; the control plane keeps the pods, their `enabled` annotations
// and True enrolled conditions). At boot, before kubelet starts anything (the
// agent included), the primary CNI's installer writes its conflist again from
// its template, as Calico's install-cni, flannel's init container and Cilium
// do: a chained entry in that file is gone. ztunnel comes back only after the
// agent and the pods' new sandboxes. With the DaemonSet's default settings,
// every ambient pod must be captured again — the CNI ADD of its new sandbox
// reaches the agent and ztunnel gets its new netns — before its app starts
// and before it turns Ready; none turns Ready while ztunnel is away; the
// config the runtime uses carries the primary's boot-time rewrite and our
// plugin; the plain pod comes back untouched.
func (r *agentRun) nodeRebootCapturesBeforeReady(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-reboot")
	plainNs := namespace(t, ctx, "plain-reboot")
	names := []string{"a", "b", "c"}
	oldIPs := map[string]string{}
	for _, name := range names {
		if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, nodeenv.GatedPod(name), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	plain, err := node.Env.CP.Admin.CoreV1().Pods(plainNs).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "plain"}, Spec: appPodSpec()}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := waitPod(ctx, plainNs, "plain", podReady); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool {
			return podReady(p) && p.Annotations[podmeta.AnnotationRedirection] == "enabled"
		})
		if err != nil {
			t.Fatal(err)
		}
		oldIPs[name] = p.Status.PodIP
	}

	// A pod that turns Ready after the reboot must be held by ztunnel with
	// its running netns right then: ztunnel's state only grows between that
	// moment and this check, so a miss here is a real miss.
	var emu atomic.Pointer[e2eenv.Emulator]
	var violations []string
	var vmu sync.Mutex
	defer func() { // also when a check below stops the test
		vmu.Lock()
		defer vmu.Unlock()
		for _, v := range violations {
			t.Error(v)
		}
	}()
	rw := watchReady(t, ctx, ns, func(p *corev1.Pod) {
		em := emu.Load()
		var msg string
		if em == nil {
			msg = fmt.Sprintf("pod %s Ready after the reboot while no ztunnel runs", p.Name)
		} else {
			var st ztunnelemu.State
			if err := em.State(ctx, &st); err != nil {
				msg = fmt.Sprintf("emulator state at pod %s Ready: %v", p.Name, err)
			} else if w, ok := st.Workload(string(p.UID)); !ok {
				msg = fmt.Sprintf("pod %s Ready after the reboot, ztunnel does not hold it (requests %v)", p.Name, opsFor(st, string(p.UID)))
			} else if path, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP)); err != nil || inodeOf(path) != w.NetnsInode {
				msg = fmt.Sprintf("pod %s Ready after the reboot, ztunnel holds netns inode %d, the pod runs in %s (%v)", p.Name, w.NetnsInode, path, err)
			}
		}
		if msg != "" {
			vmu.Lock()
			violations = append(violations, msg)
			vmu.Unlock()
		}
	})

	if err := r.em.Stop(5 * time.Second); err != nil {
		t.Logf("emulator stop: %v", err)
	}
	r.em = nil
	off := time.Now()
	if err := node.PowerOff(ctx); err != nil {
		// Boot anyway, so the node is usable for the cleanup and later tests.
		t.Errorf("power off: %v", err)
		if err := node.PowerOn(ctx); err != nil {
			t.Errorf("power on: %v", err)
		}
		t.FailNow()
	}
	t.Logf("power off: %s", time.Since(off).Round(time.Millisecond))
	bootMark := fmt.Sprintf("boot-%d", time.Now().UnixNano())
	if _, err := node.PrimaryCNIBoot(bootMark); err != nil {
		t.Fatalf("primary CNI installer at boot: %v", err)
	}
	t.Logf("primary CNI installer at boot rewrote %s from its template (%s); the runtime's config now: %s", nodeenv.Conflist, bootMark, runtimeConfig(t))
	// The primary's file is the primary's: what an uninstall must leave
	// byte for byte is now this rewrite (the agent's default mode never
	// edits it; UninstallLeavesNodeAsBefore checks against it).
	r.pristine.primaryRewrote(t)
	on := time.Now()
	if err := node.PowerOn(ctx); err != nil {
		t.Fatalf("power on: %v", err)
	}
	t.Logf("power on -> containerd and kubelet answering: %s", time.Since(on).Round(time.Millisecond))

	// Without ztunnel: the agent comes back (not ready), the ambient pods get
	// new sandboxes with the redirection in place and wait `pending`.
	if err := nodeenv.Poll(ctx, "agent answering /readyz after the reboot, ambient pods running again and pending", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		code, body, err := nodeenv.AgentReadyz(ctx)
		if err != nil {
			return false, err
		}
		if code == http.StatusOK {
			return false, fmt.Errorf("agent ready without a ztunnel: %s", body)
		}
		for _, name := range names {
			p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if !containerStartedSince(p, on) || p.Annotations[podmeta.AnnotationRedirection] != "pending" {
				return false, fmt.Errorf("pod %s: annotation %q; %s", name, p.Annotations[podmeta.AnnotationRedirection], describe(p))
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("power on -> agent back, ambient pods running and pending (no ztunnel): %s", time.Since(on).Round(time.Millisecond))
	for _, name := range names {
		p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if podReady(p) {
			t.Errorf("pod %s Ready after the reboot without ztunnel: %s", name, describe(p))
		}
		// Its new sandbox ran through our plugin, despite the primary's
		// rewrite at boot: the redirection was in place before its app
		// started.
		startedCaptured(t, ctx, p)
	}
	if t.Failed() {
		t.FailNow()
	}
	// kubelet probes them meanwhile, and its probes reach the apps: a
	// pending pod's probe entry goes in with its rules (docs/readiness.md,
	// "one rule"), so its containers turn ready (liveness would pass too:
	// no restart loop during a long ztunnel outage) — and still no pod is
	// Ready: the readiness gate holds it (the watch above records any).
	if err := nodeenv.Poll(ctx, "kubelet's probes of every pending ambient pod passing (ContainersReady) after the reboot", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		for _, name := range names {
			p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			c := nodeenv.Condition(p, corev1.ContainersReady)
			if c == nil || c.Status != corev1.ConditionTrue || !containerStartedSince(p, on) || p.Annotations[podmeta.AnnotationRedirection] != "pending" {
				return false, fmt.Errorf("pod %s: %s", name, describe(p))
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); err != nil || podReady(p) {
			t.Errorf("pod %s Ready (or unreadable: %v) while pending without ztunnel", name, err)
		}
	}
	t.Logf("power on -> kubelet's probes of every pending pod pass through the probe SNAT, none Ready: %s", time.Since(on).Round(time.Millisecond))

	em, err := node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	emu.Store(em)
	r.em = em
	ztStart := time.Now()
	for _, name := range names {
		p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool { return podReady(p) && !rw.ready(name).IsZero() })
		if err != nil {
			t.Fatal(err)
		}
		if p.Status.PodIP == oldIPs[name] {
			t.Logf("pod %s kept its IP %s", name, p.Status.PodIP)
		}
		if got := p.Annotations[podmeta.AnnotationRedirection]; got != "enabled" {
			t.Errorf("pod %s after the reboot: annotation %q, want enabled", name, got)
		}
		if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c == nil || c.Status != corev1.ConditionTrue {
			t.Errorf("pod %s after the reboot: condition %+v, want True", name, c)
		}
		add := r.capturedBeforeStart(t, ctx, p)
		t.Logf("pod %s: ztunnel back -> Add %s, -> Ready %s (power on -> Ready %s)", name,
			add.At.Sub(ztStart).Round(time.Millisecond), rw.ready(name).Sub(ztStart).Round(time.Millisecond), rw.ready(name).Sub(on).Round(time.Millisecond))
	}
	// The primary's boot-time rewrite reached the config the runtime uses,
	// with our plugin last.
	if _, text, err := node.RuntimeConfig(); err != nil || !strings.Contains(text, bootMark) || !strings.Contains(text, `"ambientd-cni"`) {
		t.Errorf("after the reboot the runtime's CNI config lacks the primary's rewrite %s or our plugin (%v): %s", bootMark, err, runtimeConfig(t))
	}

	// The plain pod is back, not enrolled, never handed to ztunnel.
	p, err := waitPod(ctx, plainNs, "plain", func(p *corev1.Pod) bool { return podReady(p) && containerStartedSince(p, on) })
	if err != nil {
		t.Fatal(err)
	}
	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	if ops := opsFor(st, string(plain.UID)); len(ops) != 0 || p.Annotations[podmeta.AnnotationRedirection] != "" {
		t.Errorf("plain pod after the reboot: ztunnel requests %v, annotation %q", ops, p.Annotations[podmeta.AnnotationRedirection])
	}
}

// containerStartedSince reports whether p's first container runs and
// started at or after t (seconds precision, as the API has it).
func containerStartedSince(p *corev1.Pod, t time.Time) bool {
	if len(p.Status.ContainerStatuses) == 0 {
		return false
	}
	r := p.Status.ContainerStatuses[0].State.Running
	return r != nil && !r.StartedAt.Time.Before(t.Truncate(time.Second))
}

// inodeOf is the inode of path (0 when it cannot be read).
func inodeOf(path string) uint64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Ino
}

// nodeNFT runs nft in the node netns (where this test and the agent run).
func nodeNFT(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	out, err := exec.CommandContext(ctx, "nft", args...).CombinedOutput()
	return string(out), err
}

// hostProbeTable returns the node's nftables host table (probe SNAT chain
// and probe sets) and fails the test when the agent does not use the
// nftables backend here.
func hostProbeTable(t *testing.T, ctx context.Context) string {
	t.Helper()
	out, err := nodeNFT(t, ctx, "list", "table", "inet", "istio-ambient-nat")
	if err != nil {
		t.Fatalf("the node has no nftables host table (the scenario needs the nftables backend): %v: %s", err, out)
	}
	return out
}

// agentProcess is the pid of the agent's ambientd process on the node: the
// one in the node's netns (the DaemonSet runs in the host network; other
// ambientd processes on this machine belong to other environments).
func agentProcess(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	nodeNetns := inodeOf("/proc/self/ns/net")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && strings.TrimSpace(string(c)) == "ambientd" &&
			inodeOf(fmt.Sprintf("/proc/%d/ns/net", pid)) == nodeNetns {
			pids = append(pids, pid)
		}
	}
	if len(pids) != 1 {
		t.Fatalf("ambientd processes on the node: %v, want exactly one (the DaemonSet's)", pids)
	}
	return pids[0]
}

// hostNetworkPodNeverAPod: a hostNetwork pod in an
// ambient namespace annotated ambient.istio.io/redirection=enabled (anyone
// who may annotate a pod can do that), then an agent restart. The host is
// never treated as a pod: ztunnel gets no Add carrying the node's netns, and
// the node's nftables host table (probe SNAT) and every meshed pod's probe
// entry survive. The annotation is set while the agent is frozen (SIGSTOP),
// so only the restart's rebuild sees it (a running agent cleans it first);
// the agent is then SIGKILLed and kubelet restarts its container.
func (r *agentRun) hostNetworkPodNeverAPod(t *testing.T, ctx context.Context) {
	ns := ambientNamespace(t, ctx, "ambient-hostnet")
	meshed, _ := startPod(t, ctx, ns, nodeenv.GatedPod("meshed"))
	meshedIP := meshed.Status.PodIP
	if !strings.Contains(hostProbeTable(t, ctx), meshedIP) {
		t.Fatalf("meshed pod %s not in the host probe set before the test:\n%s", meshedIP, hostProbeTable(t, ctx))
	}
	hostSpec := appPodSpec()
	hostSpec.HostNetwork = true
	hostPod, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "hostnet"}, Spec: hostSpec}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := waitPod(ctx, ns, "hostnet", podReady); err != nil {
		t.Fatal(err)
	}
	hostIno := inodeOf("/proc/self/ns/net")
	agentPod, err := node.AgentPod(ctx)
	if err != nil || agentPod == nil {
		t.Fatalf("agent pod: %v", err)
	}
	restarts := agentPod.Status.ContainerStatuses[0].RestartCount
	var st0 ztunnelemu.State
	if err := r.em.State(ctx, &st0); err != nil {
		t.Fatal(err)
	}

	pid := agentProcess(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"enabled"}}}`, podmeta.AnnotationRedirection)
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Patch(ctx, "hostnet", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	if err := nodeenv.Poll(ctx, "the agent restarted and Ready, the hostNetwork pod's annotation cleaned", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		if err != nil || p == nil || len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].RestartCount <= restarts || !podReady(p) {
			return false, err
		}
		h, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "hostnet", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		_, annotated := h.Annotations[podmeta.AnnotationRedirection]
		return !annotated, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("agent SIGKILLed -> restarted, Ready, the hostNetwork pod's annotation gone: %s", time.Since(restarted).Round(time.Millisecond))

	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	for _, q := range st.Requests[len(st0.Requests):] {
		if q.NetnsInode == hostIno || q.UID == string(hostPod.UID) {
			t.Errorf("ztunnel got %s for %s/%s carrying netns inode %d (the node's is %d)", q.Op, q.Namespace, q.Name, q.NetnsInode, hostIno)
		}
	}
	table := hostProbeTable(t, ctx)
	if !strings.Contains(table, "postrouting") || !strings.Contains(table, "istio-inpod-probes-v4") || !strings.Contains(table, meshedIP) {
		t.Errorf("after the restart the node's host table lost its probe SNAT or the meshed pod's entry %s:\n%s", meshedIP, table)
	}
	for _, chain := range []string{"istio-prerouting", "istio-output"} {
		if strings.Contains(table, "chain "+chain) {
			t.Errorf("in-pod chain %s in the node's own netns:\n%s", chain, table)
		}
	}
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "meshed", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("meshed pod after the restart: %s (%v)", describe(p), err)
	}
	if w, ok := st.Workload(string(meshed.UID)); !ok {
		t.Errorf("ztunnel lost the meshed pod after the restart")
	} else {
		t.Logf("meshed pod held with netns inode %d; requests since the freeze: %d", w.NetnsInode, len(st.Requests)-len(st0.Requests))
	}
}
