//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	cnins "github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	criv1 "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ambientd/ambientd/internal/e2eenv"
	"github.com/ambientd/ambientd/internal/nodeenv"
	"github.com/ambientd/ambientd/internal/ztunnelemu"
	"github.com/ambientd/ambientd/nodeagent/podmeta"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
)

const (
	// agentImage is the reference `make image` records in its archive; the
	// tag is not "latest", and the overlay sets imagePullPolicy: Never.
	agentImage = "ghcr.io/ambientd/ambientd"
	agentTag   = "dev"
	// ztunnelSocket is the agent's ZDS socket on the node (deploy/'s
	// hostPath /var/run/ztunnel, a tmpfs in the node's mount namespace).
	ztunnelSocket = "/run/ztunnel/ztunnel.sock"
	// agentHealth is the agent's health endpoint: it runs in the host
	// network, which is the node netns the test runs in.
	agentHealth = "http://127.0.0.1:8000"
	// enrolledCondition is the readiness gate the agent sets on ambient pods.
	enrolledCondition = corev1.PodConditionType("ambient.istio.io/enrolled")
	nodeConflist      = "10-ambientd-node.conflist"
)

// overlay writes a kustomize overlay on the repository's deploy/ for this
// node: the locally imported image (pull policy Never: there is no
// registry), the apiserver on loopback (there is no kube-proxy, so the
// `kubernetes` Service routes nowhere), readiness checked every second (so
// the measured times are not 5-second steps). It returns the overlay dir.
func overlay(t *testing.T, tag string) string {
	t.Helper()
	u, err := url.Parse(node.Env.CP.URL)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	base, err := filepath.Rel(dir, filepath.Join(node.Env.Root, "deploy"))
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		"kustomization.yaml": fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
images:
  - name: %s
    newTag: %s
patches:
  - path: agent.yaml
`, base, agentImage, tag),
		"agent.yaml": fmt.Sprintf(`apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ambientd
  namespace: istio-system
spec:
  template:
    spec:
      containers:
        - name: ambientd
          imagePullPolicy: Never
          env:
            - name: KUBERNETES_SERVICE_HOST
              value: %q
            - name: KUBERNETES_SERVICE_PORT
              value: %q
          readinessProbe:
            periodSeconds: 1
`, u.Hostname(), u.Port()),
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// agentImageArchive is `make image`'s output; hack/e2e-node.sh builds it.
func agentImageArchive(t *testing.T) string {
	t.Helper()
	p := filepath.Join(node.Env.Root, "bin", "ambientd-image.tar")
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("agent image: %v (run `make image` first; hack/e2e-node.sh does)", err)
	}
	return p
}

// nodeTainted reports whether the node carries the startup taint.
func nodeTainted(ctx context.Context) (bool, error) {
	n, err := node.Env.CP.Admin.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == startupTaint.Key && t.Effect == startupTaint.Effect
	}), nil
}

// readyz returns the agent's /readyz status code and body.
func readyz(ctx context.Context) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, agentHealth+"/readyz?verbose", nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(b), nil
}

func conflist(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(node.CNIConfDir, nodeConflist))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// agentPod returns the DaemonSet's pod (nil if none yet).
func agentPod(ctx context.Context) (*corev1.Pod, error) {
	pods, err := node.Env.CP.Admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "app=ambientd"})
	if err != nil || len(pods.Items) == 0 {
		return nil, err
	}
	return &pods.Items[0], nil
}

func poll(ctx context.Context, what string, interval time.Duration, cond func(ctx context.Context) (bool, error)) error {
	var lastErr error
	err := wait.PollUntilContextCancel(ctx, interval, true, func(ctx context.Context) (bool, error) {
		ok, err := cond(ctx)
		lastErr = err
		return ok && err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("%s: %w (last error: %v)", what, err, lastErr)
	}
	return nil
}

// agentRun is the agent's DaemonSet on the node and the ztunnel emulator.
type agentRun struct {
	overlay string
	em      *e2eenv.Emulator
}

// TestAgentOnRealNode runs ambientd's own DaemonSet (deploy/ through a test
// overlay, the image `make image` built) on the node, with the ztunnel
// emulator at the node's ztunnel socket, and kubelet-created pods in an
// ambient namespace. The subtests share the DaemonSet and run in order.
func TestAgentOnRealNode(t *testing.T) {
	logsOnFailure(t)
	ctx := testContext(t, 10*time.Minute)
	before, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Last: the steps' namespaces are deleted asynchronously; the node is
	// back to its state before (no pod netns, lease, task, shim or cgroup
	// left) before the next test looks at it.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		var now nodeenv.State
		if err := poll(ctx, "node back to its state before the agent tests", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
			var err error
			now, err = node.State(ctx)
			return err == nil && len(now.Diff(before)) == 0, err
		}); err != nil {
			t.Errorf("%v\nbefore: %s\nnow:    %s", err, before, now)
		}
	})
	r := &agentRun{}
	t.Cleanup(func() { r.remove(t) })
	steps := []struct {
		name string
		fn   func(*testing.T, context.Context)
	}{
		{"DaemonSetReadyOnlyAfterZtunnel", r.daemonSetReadyOnlyAfterZtunnel},
		{"AmbientPodEnrolledCapturedReady", r.ambientPodEnrolledCapturedReady},
		{"GatedPodNotReadyWithoutZtunnel", r.gatedPodNotReadyWithoutZtunnel},
		{"StartupCost", r.startupCost},
		{"SandboxRecreatedStaysEnrolled", r.sandboxRecreatedStaysEnrolled},
		{"RollingUpdateKeepsCapture", r.rollingUpdateKeepsCapture},
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
	if strings.Contains(conflist(t), `"ambientd-cni"`) {
		t.Fatalf("the node's conflist mentions ambientd before the agent runs:\n%s", conflist(t))
	}
	if err := node.ImportImage(ctx, agentImageArchive(t)); err != nil {
		t.Fatal(err)
	}
	r.overlay = overlay(t, agentTag)
	start := time.Now()
	if out, err := node.Kubectl(ctx, "apply", "-k", r.overlay); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("kubectl apply -k:\n%s", out)
	}
	// The plugin is installed and the agent answers /readyz: not ready, the
	// ztunnel is missing.
	var body string
	if err := poll(ctx, "agent installs the plugin and serves /readyz", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		if !strings.Contains(conflist(t), `"ambientd-cni"`) {
			return false, fmt.Errorf("plugin not in %s yet", nodeConflist)
		}
		code, b, err := readyz(ctx)
		body = b
		return err == nil && code != 0, err
	}); err != nil {
		p, _ := agentPod(context.Background())
		t.Fatalf("%v; agent pod: %s", err, describe(p))
	}
	installed := time.Since(start)
	code, body, err := readyz(ctx)
	if err != nil || code == http.StatusOK {
		t.Fatalf("agent /readyz without a ztunnel: %d %v\n%s", code, err, body)
	}
	t.Logf("apply -> plugin installed, /readyz answering: %s; /readyz without ztunnel: %d\n%s", installed.Round(time.Millisecond), code, body)
	// Kubelet ran the readiness probe against that: the pod is not Ready and
	// the taint stays. Wait for the probe to have run at least once.
	if err := poll(ctx, "agent pod running, probed not ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := agentPod(ctx)
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
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: ztunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	var readyAt, untaintedAt time.Duration
	if err := poll(ctx, "DaemonSet Ready and taint removed after ztunnel connected", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
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
		if err := poll(ctx, "agent pod gone and plugin uninstalled", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
			p, err := agentPod(ctx)
			return p == nil && !strings.Contains(conflist(t), `"ambientd-cni"`), err
		}); err != nil {
			t.Errorf("%v; conflist:\n%s", err, conflist(t))
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

// gatedPod is the app pod with the enrolled readiness gate; it does not
// tolerate the startup taint.
func gatedPod(name string) *corev1.Pod {
	grace := int64(5)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			Containers:                    []corev1.Container{nodeenv.AppContainer()},
			TerminationGracePeriodSeconds: &grace,
			ReadinessGates:                []corev1.PodReadinessGate{{ConditionType: enrolledCondition}},
		},
	}
}

func condition(p *corev1.Pod, typ corev1.PodConditionType) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == typ {
			return &p.Status.Conditions[i]
		}
	}
	return nil
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
	if err := poll(ctx, "emulator: "+what, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
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
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, gatedPod("web"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	r.waitEmu(t, ctx, "a refused Add for "+workload, func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Requests, func(q ztunnelemu.RequestRecord) bool {
			return q.UID == uid && q.Op == "add" && q.AckError != ""
		})
	})
	// The agent recorded the refusal on the pod (pending: its probe
	// addresses are set only after an ack, so kubelet's probes fail too).
	p, err := waitPod(ctx, ns, "web", func(p *corev1.Pod) bool {
		c := condition(p, enrolledCondition)
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
	if c := condition(p, enrolledCondition); c == nil || c.Status != corev1.ConditionTrue {
		t.Errorf("condition %s: %+v, want True", enrolledCondition, c)
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
	if err := poll(ctx, "more probes through the SNAT", 500*time.Millisecond, func(ctx context.Context) (bool, error) {
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
	if err := poll(ctx, "pod gone from the API, its netns from the node", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
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
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, gatedPod("gated"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := waitPod(ctx, ns, "gated", func(p *corev1.Pod) bool {
		c := condition(p, enrolledCondition)
		return p.Status.Phase == corev1.PodRunning && p.Annotations[podmeta.AnnotationRedirection] != "" && c != nil && c.Status == corev1.ConditionFalse
	})
	if err != nil {
		t.Fatal(err)
	}
	if podReady(p) {
		t.Fatalf("gated pod Ready without ztunnel: %s", describe(p))
	}
	if c := condition(p, enrolledCondition); c != nil && c.Status == corev1.ConditionTrue {
		t.Fatalf("condition %s True without ztunnel: %+v", enrolledCondition, c)
	}
	t.Logf("without ztunnel: annotation %q; %s", p.Annotations[podmeta.AnnotationRedirection], describe(p))
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: ztunnelSocket, NetnsMode: true})
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
	h, err := podnetns.Open(netnsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	err = h.Do(func(cnins.NetNS) error {
		c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", dst)
		if err == nil {
			c.Close()
		}
		return err
	})
	if err != nil {
		t.Fatalf("dial %s from %s: %v", dst, netnsPath, err)
	}
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
			{ambient, gatedPod("app")},
		} {
			start := time.Now()
			if _, err := node.Env.CP.Admin.CoreV1().Pods(c.ns).Create(ctx, c.pod, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := waitPod(ctx, c.ns, "app", podReady); err != nil {
				t.Fatal(err)
			}
			t.Logf("run %d: %s pod create -> Ready: %s", i+1, c.ns, time.Since(start).Round(time.Millisecond))
			deletePodAndWait(t, ctx, c.ns, "app")
		}
	}
}

func deletePodAndWait(t *testing.T, ctx context.Context, ns, name string) {
	t.Helper()
	if err := node.Env.CP.Admin.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := poll(ctx, "pod "+ns+"/"+name+" gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatal(err)
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
	created, oldNetns := startPod(t, ctx, ns, gatedPod("web"))
	uid := string(created.UID)
	oldInode := inode(t, oldNetns)
	pause := processIn(t, oldInode, "pause")
	if err := unixKill(pause); err != nil {
		t.Fatal(err)
	}
	// A new sandbox: a new netns, enrolled, the pod Ready again.
	var newInode uint64
	st := r.waitEmu(t, ctx, "Add with a new netns", func(s ztunnelemu.State) bool {
		w, ok := s.Workload(uid)
		newInode = w.NetnsInode
		return ok && w.NetnsInode != oldInode
	})
	if _, err := waitPod(ctx, ns, "web", podReady); err != nil {
		t.Fatal(err)
	}
	t.Logf("sandbox recreated: netns inode %d -> %d; requests for the pod: %s", oldInode, newInode, opsFor(st, uid))
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
		var st syscall.Stat_t
		if syscall.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st) == nil && st.Ino == ino {
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
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, gatedPod("before"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	if _, err := waitPod(ctx, ns, "before", podReady); err != nil {
		t.Fatal(err)
	}
	old, err := agentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("agent pod: %v", err)
	}
	const newTag = "dev-update"
	out, err := exec.CommandContext(ctx, node.Bins.Ctr, "--address", node.ContainerdAddress, "--namespace", "k8s.io",
		"images", "tag", "--force", agentImage+":"+agentTag, agentImage+":"+newTag).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images tag: %v: %s", err, out)
	}
	start := time.Now()
	if _, err := node.Kubectl(ctx, "apply", "-k", overlay(t, newTag)); err != nil {
		t.Fatal(err)
	}
	during, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, gatedPod("during"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := poll(ctx, "DaemonSet rolled to "+newTag, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := agentPod(ctx)
		if err != nil || p == nil || p.UID == old.UID {
			return false, err
		}
		return p.Spec.Containers[0].Image == agentImage+":"+newTag && podReady(p), nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("apply new tag -> new agent pod Ready: %s", time.Since(start).Round(time.Millisecond))
	if _, err := waitPod(ctx, ns, "during", podReady); err != nil {
		t.Fatal(err)
	}
	st := r.waitEmu(t, ctx, "both pods held by ztunnel", func(s ztunnelemu.State) bool {
		_, a := s.Workload(uid)
		_, b := s.Workload(string(during.UID))
		return a && b
	})
	if ops := opsFor(st, uid); slices.Contains(ops, "del") {
		t.Errorf("the enrolled pod got a Del during the update: %v", ops)
	}
	// Still captured: its outbound connection lands on 15001.
	w, _ := st.Workload(uid)
	dialFrom(t, ctx, netnsByInode(t, w.NetnsInode), netip.AddrPortFrom(node.IP, 9).String())
	r.waitEmu(t, ctx, "outbound connection of the enrolled pod after the update", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
	})
	p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "before", metav1.GetOptions{})
	if err != nil || !podReady(p) || p.Annotations[podmeta.AnnotationRedirection] != "enabled" {
		t.Errorf("enrolled pod after the update: %s (%v)", describe(p), err)
	}
	if !strings.Contains(conflist(t), `"ambientd-cni"`) {
		t.Errorf("plugin gone from the conflist after the update:\n%s", conflist(t))
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
		p := filepath.Join(node.NetnsDir, e.Name())
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil && st.Ino == ino {
			return p
		}
	}
	t.Fatalf("no netns with inode %d in %s", ino, node.NetnsDir)
	return ""
}
