//go:build e2e

package e2e

// The package's shared helpers: the scenario every test starts from, and
// what tests do with the agent, the ztunnel emulator, pods and namespaces.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

const (
	labelMode     = "istio.io/dataplane-mode"
	annRedirect   = "ambient.istio.io/redirection"
	annSidecar    = "sidecar.istio.io/status"
	annDNSCapture = "ambient.istio.io/dns-capture"
)

// xtablesBackend pins the iptables-nft backend for the tests that read,
// wipe or edit rules with the iptables tools and ipset (a native nftables
// backend keeps its rules and probe set elsewhere).
const xtablesBackend = "AMBIENTD_IPTABLES=nft"

// scenario is what an end-to-end test starts from, set up the same way for
// every test (the pattern of Kubernetes e2e's NewDefaultFramework): a
// context bounded by the test's budget, a namespace of its own, a ztunnel
// emulator in netns mode, and bin/ambientd live, serving its CNI socket and
// ready (ztunnel connected, snapshot acked). Options take parts away or
// change them. The agent and the emulator stop when the test ends, after the
// pods the test created are deleted.
type scenario struct {
	ctx   context.Context
	ns    string           // the test's namespace, labelled ambient unless plainNamespace
	em    *e2eenv.Emulator // nil with withoutZtunnel
	agent *e2eenv.Agent    // nil with withoutAgent
}

type scenarioConfig struct {
	timeout  time.Duration
	ambient  bool
	ztunnel  bool
	agent    bool
	agentCfg e2eenv.AgentConfig
}

// scenarioOption changes what newScenario sets up.
type scenarioOption func(*scenarioConfig)

// within gives the test a budget other than the default four minutes.
func within(d time.Duration) scenarioOption { return func(c *scenarioConfig) { c.timeout = d } }

// plainNamespace leaves the test's namespace without the ambient label.
func plainNamespace() scenarioOption { return func(c *scenarioConfig) { c.ambient = false } }

// withoutZtunnel starts no emulator: the agent runs with no ztunnel (and is
// not waited for to be ready); the test starts one when it wants.
func withoutZtunnel() scenarioOption { return func(c *scenarioConfig) { c.ztunnel = false } }

// withoutAgent starts no agent: the test starts its own.
func withoutAgent() scenarioOption { return func(c *scenarioConfig) { c.agent = false } }

// agentArgs are flags for the agent, after the environment's defaults.
func agentArgs(args ...string) scenarioOption {
	return func(c *scenarioConfig) { c.agentCfg.Args = append(c.agentCfg.Args, args...) }
}

// agentEnv is extra environment for the agent (settings through their env
// vars).
func agentEnv(env ...string) scenarioOption {
	return func(c *scenarioConfig) { c.agentCfg.Env = append(c.agentCfg.Env, env...) }
}

// newScenario sets up the test's scenario; name prefixes the namespace and
// names the emulator.
func newScenario(t *testing.T, name string, opts ...scenarioOption) *scenario {
	t.Helper()
	c := scenarioConfig{timeout: 4 * time.Minute, ambient: true, ztunnel: true, agent: true}
	for _, o := range opts {
		o(&c)
	}
	s := &scenario{ctx: testutil.Context(t, c.timeout), ns: uniqueNS(name)}
	createNamespace(t, s.ctx, s.ns, c.ambient)
	if c.ztunnel {
		s.em = startEmulator(t, s.ctx, "ztunnel-"+name)
	}
	if c.agent {
		s.agent = startAgentWith(t, s.ctx, c.agentCfg)
		if c.ztunnel {
			if err := s.agent.WaitReady(s.ctx); err != nil {
				t.Fatalf("agent not ready with a ztunnel connected: %v\n%s", err, s.agent.LogTail(50))
			}
		}
	}
	return s
}

var nsCounter atomic.Int32

// uniqueNS returns a fresh namespace name for one test.
func uniqueNS(prefix string) string {
	return fmt.Sprintf("%s-%d-%d", prefix, os.Getpid()%1000, nsCounter.Add(1))
}

// startAgent starts bin/ambientd and waits until it is live; it is stopped
// when the test ends (after the test's pods are deleted, registered later).
func startAgent(t *testing.T, ctx context.Context, args ...string) *e2eenv.Agent {
	t.Helper()
	return startAgentWith(t, ctx, e2eenv.AgentConfig{Args: args})
}

// startAgentWith is startAgent with the whole AgentConfig (environment too).
func startAgentWith(t *testing.T, ctx context.Context, cfg e2eenv.AgentConfig) *e2eenv.Agent {
	t.Helper()
	a, err := testEnv.StartAgent(ctx, cfg)
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	a.LogOnFailure(t)
	t.Cleanup(func() {
		if err := a.Stop(10 * time.Second); err != nil {
			t.Errorf("stop agent: %v", err)
		}
	})
	if err := a.WaitLive(ctx); err != nil {
		t.Fatalf("agent not live: %v\n%s", err, a.LogTail(50))
	}
	waitCNIServing(t, ctx)
	return a
}

// waitCNIServing waits until the agent accepts connections on its CNI socket
// (it serves only after its caches synced and its registry is rebuilt).
func waitCNIServing(t *testing.T, ctx context.Context) {
	t.Helper()
	testutil.Until(t, ctx, "agent serving the CNI socket", func() bool {
		c, err := net.DialTimeout("unix", testEnv.CNISocket, time.Second)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
}

func startEmulator(t *testing.T, ctx context.Context, name string) *e2eenv.Emulator {
	t.Helper()
	em, err := testEnv.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: name})
	if err != nil {
		t.Fatalf("start emulator: %v", err)
	}
	em.LogOnFailure(t)
	t.Cleanup(func() {
		if err := em.Stop(10 * time.Second); err != nil {
			t.Errorf("stop emulator: %v", err)
		}
	})
	return em
}

// createPod creates a pod through the CNI chain and deletes it when the test
// ends (CNI DEL, netns, object).
func createPod(t *testing.T, ctx context.Context, spec e2eenv.PodSpec) *e2eenv.Pod {
	t.Helper()
	p, err := testEnv.CreatePod(ctx, spec)
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", spec.Namespace, spec.Name, err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := testEnv.DeletePod(cctx, p); err != nil {
			t.Errorf("delete pod %s/%s: %v", p.Namespace, p.Name, err)
		}
	})
	return p
}

func createNamespace(t *testing.T, ctx context.Context, name string, ambient bool) {
	t.Helper()
	var labels map[string]string
	if ambient {
		labels = map[string]string{labelMode: "ambient"}
	}
	if _, err := testEnv.CreateNamespace(ctx, name, labels); err != nil {
		t.Fatal(err)
	}
}

func setNamespaceMode(t *testing.T, ctx context.Context, name, mode string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, labelMode, jsonOrNull(mode))
	if _, err := testEnv.CP.Admin.CoreV1().Namespaces().Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

func setPodMode(t *testing.T, ctx context.Context, p *e2eenv.Pod, mode string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, labelMode, jsonOrNull(mode))
	if _, err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

func jsonOrNull(s string) string {
	if s == "" {
		return "null"
	}
	b, _ := json.Marshal(s)
	return string(b)
}

func waitAnnotation(t *testing.T, ctx context.Context, p *e2eenv.Pod, want string) {
	t.Helper()
	if _, err := testEnv.WaitForPodAnnotation(ctx, p.Namespace, p.Name, annRedirect, want); err != nil {
		t.Fatalf("pod %s/%s annotation %s=%q: %v", p.Namespace, p.Name, annRedirect, want, err)
	}
}

func waitPodAnnotationObj(t *testing.T, ctx context.Context, p *e2eenv.Pod, want string) *corev1.Pod {
	t.Helper()
	o, err := testEnv.WaitForPodAnnotation(ctx, p.Namespace, p.Name, annRedirect, want)
	if err != nil {
		t.Fatalf("pod %s/%s annotation %s=%q: %v", p.Namespace, p.Name, annRedirect, want, err)
	}
	return o
}

func waitNoAnnotation(t *testing.T, ctx context.Context, p *e2eenv.Pod) {
	t.Helper()
	if _, err := testEnv.WaitForPod(ctx, p.Namespace, p.Name, func(o *corev1.Pod) (bool, error) {
		_, ok := o.Annotations[annRedirect]
		return !ok, nil
	}); err != nil {
		t.Fatalf("pod %s/%s annotation %s not removed: %v", p.Namespace, p.Name, annRedirect, err)
	}
}

func annotationOf(t *testing.T, ctx context.Context, p *e2eenv.Pod) (string, bool) {
	t.Helper()
	o, err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, ok := o.Annotations[annRedirect]
	return v, ok
}

// annotatedUIDs lists this node's pods annotated enabled or pending.
func annotatedUIDs(t *testing.T, ctx context.Context) []string {
	t.Helper()
	list, err := testEnv.CP.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + testEnv.NodeName})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range list.Items {
		switch p.Annotations[annRedirect] {
		case "enabled", "pending":
			out = append(out, string(p.UID))
		}
	}
	sort.Strings(out)
	return out
}

// createObjectOnly creates the Pod object without sandbox or CNI.
func createObjectOnly(t *testing.T, ctx context.Context, namespace, name string) *corev1.Pod {
	t.Helper()
	if err := testEnv.EnsureServiceAccount(ctx, namespace, "default"); err != nil {
		t.Fatal(err)
	}
	obj, err := testEnv.CP.Admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PodSpec{NodeName: testEnv.NodeName, ServiceAccountName: "default",
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/e2e/app:1"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = testEnv.CP.Admin.CoreV1().Pods(namespace).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	return obj
}

func emuState(t *testing.T, ctx context.Context, em *e2eenv.Emulator) ztunnelemu.State {
	t.Helper()
	var st ztunnelemu.State
	if err := em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// waitEmu polls the emulator's state until cond holds.
func waitEmu(t *testing.T, ctx context.Context, em *e2eenv.Emulator, what string, cond func(ztunnelemu.State) bool) ztunnelemu.State {
	t.Helper()
	raw, err := em.WaitState(ctx, func(b []byte) (bool, error) {
		var st ztunnelemu.State
		if err := json.Unmarshal(b, &st); err != nil {
			return false, err
		}
		return cond(st), nil
	})
	if err != nil {
		t.Fatalf("emulator: waiting for %s: %v", what, err)
	}
	var st ztunnelemu.State
	_ = json.Unmarshal(raw, &st)
	return st
}

func countOps(st ztunnelemu.State, op, uid string) int {
	n := 0
	for _, r := range st.Requests {
		if r.Op == op && r.UID == uid {
			n++
		}
	}
	return n
}

// startAndAwaitSnapshot starts the (stopped) agent again and returns the
// emulator's state once the new connection's snapshot is complete, with that
// connection.
func startAndAwaitSnapshot(t *testing.T, ctx context.Context, a *e2eenv.Agent, em *e2eenv.Emulator) (ztunnelemu.State, ztunnelemu.ConnRecord) {
	t.Helper()
	connsBefore := len(emuState(t, ctx, em).Connections)
	if err := a.Start(); err != nil {
		t.Fatalf("restart agent: %v", err)
	}
	waitCNIServing(t, ctx)
	st := waitEmu(t, ctx, em, "snapshot from the restarted agent", func(s ztunnelemu.State) bool {
		return len(s.Connections) > connsBefore && s.Connections[len(s.Connections)-1].SnapshotSent
	})
	return st, st.Connections[len(st.Connections)-1]
}

// addInodes maps each uid Added on connection c to the netns inode it carried.
func addInodes(st ztunnelemu.State, c ztunnelemu.ConnRecord) map[string]uint64 {
	inodes := map[string]uint64{}
	for _, r := range st.RequestsOn(c.ID) {
		if r.Op == "add" {
			inodes[r.UID] = r.NetnsInode
		}
	}
	return inodes
}

// netnsInode is the inode of the pod's network namespace, as the emulator
// reports it for the fd it received.
func netnsInode(t *testing.T, p *e2eenv.Pod) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(p.NetnsPath, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// podRules returns our rules inside the pod's netns (e2eenv's Pod.Rules).
func podRules(t *testing.T, p *e2eenv.Pod) string {
	t.Helper()
	r, err := p.Rules()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// outsideAddr is an address in the pod subnet that nobody holds: routable
// from the pod (so connect reaches the nat OUTPUT hook) but outside it.
func outsideAddr() string {
	pfx := testEnv.Chain.Subnet()
	a := pfx.Addr()
	for range 250 {
		a = a.Next()
	}
	return netip.AddrPortFrom(a, 8080).String()
}

func informerPods(t *testing.T, ctx context.Context, a *e2eenv.Agent) int {
	t.Helper()
	return int(metricValue(t, ctx, a, "ambientd_informer_pods", ""))
}

// metricValue reads one sample from the agent's /metrics; labels is the
// exact label text (e.g. `reason="rules"`), or "" for an unlabelled metric.
func metricValue(t *testing.T, ctx context.Context, a *e2eenv.Agent, name, labels string) float64 {
	t.Helper()
	v, err := a.Metric(ctx, name, labels)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// runPluginAdd execs bin/ambientd-cni directly (as the runtime would, as the
// last plugin of a chain) with a prevResult, for inputs the reference
// plugins before it would reject.
func runPluginAdd(ctx context.Context, pod *corev1.Pod, netnsPath string) (string, error) {
	conf := e2eenv.AmbientPluginConf(testEnv.CNISocket, testEnv.CNIPluginLog)
	conf["cniVersion"] = "1.0.0"
	conf["name"] = "e2e-direct"
	conf["prevResult"] = map[string]any{
		"cniVersion": "1.0.0",
		"interfaces": []any{map[string]any{"name": "eth0", "sandbox": netnsPath}},
		"ips":        []any{map[string]any{"address": "10.88.0.254/24", "interface": 0}},
	}
	stdin, err := json.Marshal(conf)
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, testEnv.Bins.CNIPlugin)
	cmd.Stdin = bytes.NewReader(stdin)
	cmd.Env = append(os.Environ(),
		"CNI_COMMAND=ADD",
		"CNI_CONTAINERID=e2e-direct",
		"CNI_NETNS="+netnsPath,
		"CNI_IFNAME=eth0",
		"CNI_PATH="+filepath.Dir(testEnv.Bins.CNIPlugin),
		fmt.Sprintf("CNI_ARGS=K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_UID=%s", pod.Namespace, pod.Name, pod.UID),
	)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// startAgentEnv is startAgent with extra environment (settings through
// their env vars, which an older binary ignores instead of refusing).
func startAgentEnv(t *testing.T, ctx context.Context, env ...string) *e2eenv.Agent {
	t.Helper()
	return startAgentWith(t, ctx, e2eenv.AgentConfig{Env: env})
}

// pauseAPIServer SIGSTOPs the kube-apiserver (connections stay open, no
// answer comes) and returns what resumes it; a cleanup resumes it if the
// test ends first.
func pauseAPIServer(t *testing.T) (resume func()) {
	t.Helper()
	if err := testEnv.CP.APIServer.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := true
	resume = func() {
		if stopped {
			stopped = false
			if err := testEnv.CP.APIServer.Signal(syscall.SIGCONT); err != nil {
				t.Errorf("SIGCONT kube-apiserver: %v", err)
			}
		}
	}
	t.Cleanup(resume)
	return resume
}

// stopAPIServer stops the kube-apiserver and returns what starts it again
// and waits until it serves; if the test ends first, a cleanup starts it.
func stopAPIServer(t *testing.T, ctx context.Context) (restart func()) {
	t.Helper()
	if err := testEnv.CP.APIServer.Stop(10 * time.Second); err != nil {
		t.Fatalf("stop kube-apiserver: %v", err)
	}
	up := false
	t.Cleanup(func() {
		if !up {
			_ = testEnv.CP.APIServer.Start()
			_ = testEnv.CP.WaitReady(context.Background())
		}
	})
	return func() {
		t.Helper()
		if err := testEnv.CP.APIServer.Start(); err != nil {
			t.Fatalf("restart kube-apiserver: %v", err)
		}
		if err := testEnv.CP.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		up = true
	}
}

// lastLines is the last n lines of s (a log read from a file).
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// applyAgentDaemonSet creates deploy/'s DaemonSet (it selects this node),
// so an agent's shutdown rule sees an installation that stays; it is
// deleted when the test ends.
func applyAgentDaemonSet(t *testing.T, ctx context.Context) *unstructured.Unstructured {
	t.Helper()
	var ds *unstructured.Unstructured
	for _, o := range renderDeploy(t) {
		if o.GetKind() == "DaemonSet" {
			ds = o
		}
	}
	if ds == nil {
		t.Fatal("deploy/ renders no DaemonSet")
	}
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	if err := serverSideApply(ctx, dyn, mapper, ds, false); err != nil {
		t.Fatalf("creating the DaemonSet: %v", err)
	}
	t.Cleanup(func() {
		_ = testEnv.CP.Admin.AppsV1().DaemonSets(ds.GetNamespace()).Delete(context.Background(), ds.GetName(), metav1.DeleteOptions{})
	})
	return ds
}

// deleteAgentDaemonSet deletes ds and waits until it is gone: the
// uninstall an agent's shutdown rule then sees.
func deleteAgentDaemonSet(t *testing.T, ctx context.Context, ds *unstructured.Unstructured) {
	t.Helper()
	admin := testEnv.CP.Admin
	if err := admin.AppsV1().DaemonSets(ds.GetNamespace()).Delete(ctx, ds.GetName(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "DaemonSet gone", time.Minute, func() bool {
		_, err := admin.AppsV1().DaemonSets(ds.GetNamespace()).Get(ctx, ds.GetName(), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
}
