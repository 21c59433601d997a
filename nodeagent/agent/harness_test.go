package agent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	dto "github.com/prometheus/client_model/go"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

const node = "node-1"

// sharedDeps are the parts of Deps the daemon shares between the agent and
// the process's other parts, as it builds them: the informers of node
// (started by the caller) and the Event broadcaster, sending to client
// until the test ends.
func sharedDeps(t testing.TB, client kube.Interface) Deps {
	t.Helper()
	events := kube.NewEvents(client, node)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { events.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return Deps{Client: client, Informers: kube.NewInformers(client, node), Recorder: events.Recorder()}
}

// harness is what every agent test starts from (newHarness): a fake API
// server holding the test's objects, the fakes of fakes_test.go, a pod
// network namespace, and the agent running on them as the daemon runs it.
type harness struct {
	t testing.TB
	// podNetns is the path of the pod netns CNI events name: fakePodNetns
	// behind fakeNetns (no root needed), or with withRealNetns a real one
	// (root) whose lo holds 127.0.0.1.
	podNetns string
	client   *fake.Clientset
	zt       *fakeZtunnel
	rules    *fakeRules
	agent    *Agent
	// cni is the agent's CNI edge (HandleAdd, HandleDel), sidecar mode off
	// unless a beforeRun turns it on.
	cni *CNI
	reg *registry.Registry
	// istio are Istio's names the agent counts (registered with its
	// metrics).
	istio *istiometrics.Metrics
	// stop stops the agent and waits for Run to return (at most once; the
	// test's cleanup calls it too).
	stop func()
}

// harnessOption changes what newHarness sets up, before anything runs.
type harnessOption func(*harnessSetup)

type harnessSetup struct {
	objects  []runtime.Object // namespaces and pods in the fake API
	reactors []reactor
	config   []func(*Config)
	rules    *fakeRules
	// realNetns: the agent reaches namespaces through podnetns (real
	// ones, root), not fakeNetns.
	realNetns bool
	// netns wraps what the agent reaches namespaces through.
	netns func(Netns) Netns
	// beforeRun changes the agent after New, before it runs.
	beforeRun []func(*harness)
}

type reactor struct {
	verb, resource string
	fn             k8stesting.ReactionFunc
}

// withObjects puts namespaces and pods in the fake API before the agent
// starts (its restart rebuild sees them).
func withObjects(objs ...runtime.Object) harnessOption {
	return func(s *harnessSetup) { s.objects = append(s.objects, objs...) }
}

// withConfig changes the agent's Config (after the harness's defaults: fast
// retries, short lookups, an empty host /proc).
func withConfig(mut func(*Config)) harnessOption {
	return func(s *harnessSetup) { s.config = append(s.config, mut) }
}

// withRealNetns gives the agent the real podnetns.Finder of its HostProc
// and a real pod netns (root; the test skips under -short as another
// user): for tests that tell several namespaces apart. A test that sets
// HostProc or RunDir (a /proc or state file naming real namespaces) gets it
// too.
func withRealNetns() harnessOption { return func(s *harnessSetup) { s.realNetns = true } }

// withNetnsWrapper puts wrap around what the agent reaches namespaces
// through (fakeNetns, or with withRealNetns the real Finder).
func withNetnsWrapper(wrap func(Netns) Netns) harnessOption {
	return func(s *harnessSetup) { s.netns = wrap }
}

// beforeRun changes the agent and its CNI edge after New, before they (and
// the informers) run: seams, sidecar mode, handlers on its informers.
func beforeRun(fn func(*harness)) harnessOption {
	return func(s *harnessSetup) { s.beforeRun = append(s.beforeRun, fn) }
}

// withRules hands the agent these fake rules (set up before its restart
// rebuild runs) instead of fresh ones.
func withRules(r *fakeRules) harnessOption { return func(s *harnessSetup) { s.rules = r } }

// withReactor prepends fn to the fake client's reactors for verb on
// resource, before the informers start (the fake's reactor chain is not safe
// to change while they list and watch).
func withReactor(verb, resource string, fn k8stesting.ReactionFunc) harnessOption {
	return func(s *harnessSetup) { s.reactors = append(s.reactors, reactor{verb, resource, fn}) }
}

// newHarness starts the agent as the daemon does, on a fake API, a fake
// ztunnel (not connected until h.zt.connect) and fake rules, and waits until
// it runs. It stops when the test ends.
func newHarness(t testing.TB, opts ...harnessOption) *harness {
	t.Helper()
	setup := harnessSetup{rules: &fakeRules{probes: map[string][]netip.Addr{}}}
	for _, o := range opts {
		o(&setup)
	}
	client := fake.NewClientset()
	for _, r := range setup.reactors {
		client.PrependReactor(r.verb, r.resource, r.fn)
	}
	for _, o := range setup.objects {
		var err error
		switch o := o.(type) {
		case *corev1.Namespace:
			_, err = client.CoreV1().Namespaces().Create(t.Context(), o, metav1.CreateOptions{})
		case *corev1.Pod:
			_, err = client.CoreV1().Pods(o.Namespace).Create(t.Context(), o, metav1.CreateOptions{})
		case *nodev1.RuntimeClass:
			_, err = client.NodeV1().RuntimeClasses().Create(t.Context(), o, metav1.CreateOptions{})
		default:
			err = fmt.Errorf("newHarness: cannot seed a %T", o)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	h := &harness{t: t, client: client, zt: &fakeZtunnel{nack: map[string]string{}}, rules: setup.rules, reg: registry.New(), istio: istiometrics.New()}
	emptyProc := t.TempDir()
	cfg := Config{
		NodeName:         node,
		Policy:           policy.DefaultConfig(),
		PodLookupTimeout: 500 * time.Millisecond,
		CacheWait:        100 * time.Millisecond,
		RetryBaseDelay:   20 * time.Millisecond,
		RetryMaxDelay:    200 * time.Millisecond,
		HostProc:         emptyProc, // empty: no running pod is ever found
		// As the flag's default.
		MissingGateEvents: true,
	}
	for _, mut := range setup.config {
		mut(&cfg)
	}
	deps := sharedDeps(t, kubetest.Wrap(client))
	deps.Ztunnel, deps.Rules, deps.Registry, deps.Istio = h.zt, h.rules, h.reg, h.istio
	if setup.realNetns || cfg.HostProc != emptyProc || cfg.RunDir != "" {
		h.podNetns = testutil.NewNetNS(t).NS.Path() // before the agent: removed after it stopped
	} else {
		h.podNetns = fakePodNetns
		deps.Netns = &fakeNetns{Finder: podnetns.New(emptyProc)}
	}
	if setup.netns != nil {
		if deps.Netns == nil {
			deps.Netns = podnetns.New(cfg.HostProc)
		}
		deps.Netns = setup.netns(deps.Netns)
	}
	deps.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	a, err := New(cfg, deps)
	if err != nil {
		t.Fatal(err)
	}
	h.agent, h.cni = a, NewCNI(a)
	for _, fn := range setup.beforeRun {
		fn(h)
	}
	if err := h.istio.Register(a.Metrics(), istiometrics.Sources{}); err != nil {
		t.Fatal(err)
	}
	h.zt.source = a.Snapshot
	// As the daemon does: the informers start once the agent added its
	// handlers, and the ztunnel server once the agent is ready.
	// The status writer stops after the agent, as in the daemon (a
	// handover's last writes go through it).
	stopWriter := testutil.Run(t, func(ctx context.Context) error {
		return a.RunStatusWriter(ctx)
	})
	stopAgent := testutil.Run(t, func(ctx context.Context) error {
		deps.Informers.Start(ctx.Done())
		return a.Run(ctx, func() { go h.zt.Run(ctx) })
	})
	h.stop = func() {
		stopAgent()
		stopWriter()
		deps.Informers.Shutdown()
	}
	t.Cleanup(h.stop)
	h.waitFor("agent running", func() bool { return a.running.Load() })
	return h
}

// setNamespace labels namespace name ambient or not (replacing its labels).
func (h *harness) setNamespace(name string, ambient bool) {
	h.t.Helper()
	if _, err := h.client.CoreV1().Namespaces().Update(h.t.Context(), namespace(name, ambient), metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

// enrollConnected connects ztunnel, enrolls p through a CNI ADD and waits
// for its enabled annotation.
func (h *harness) enrollConnected(p *corev1.Pod) {
	h.t.Helper()
	h.zt.connect()
	if out, err := h.cni.HandleAdd(h.t.Context(), h.event(p)); err != nil || out != Enrolled {
		h.t.Fatalf("HandleAdd = %v, %v", out, err)
	}
	h.waitFor("annotation enabled", func() bool { v, _ := h.annotation(p.Namespace, p.Name); return v == "enabled" })
}

// put registers e as it is, as a restart's rebuild does.
func (h *harness) put(e registry.Entry) {
	h.t.Helper()
	if _, err := h.reg.Update(e.UID, func(cur *registry.Entry) { *cur = e }); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	testutil.WaitFor(h.t, what, cond)
}

func (h *harness) annotation(namespace, name string) (string, bool) {
	p, err := h.client.CoreV1().Pods(namespace).Get(h.t.Context(), name, metav1.GetOptions{})
	if err != nil {
		return "<" + err.Error() + ">", false
	}
	v, ok := p.Annotations[podmeta.AnnotationRedirection]
	return v, ok
}

func (h *harness) state(uid string) string {
	e, ok := h.reg.Get(uid)
	if !ok {
		return "absent"
	}
	return e.Phase.String()
}

// event is a CNI event for p in the harness's pod netns (the fake rules
// never enter it).
func (h *harness) event(p *corev1.Pod) PodEvent {
	ev := PodEvent{
		Name: p.Name, Namespace: p.Namespace, UID: string(p.UID),
		NetnsPath: h.podNetns,
		IPs:       []netip.Prefix{netip.MustParsePrefix("10.1.0.5/24")},
	}
	if ips := podmeta.IPs(p); len(ips) > 0 { // the runtime's and the API's agree
		ev.IPs = nil
		for _, ip := range ips {
			ev.IPs = append(ev.IPs, netip.PrefixFrom(ip, ip.BitLen()))
		}
	}
	return ev
}

// firstSnapshot waits until the ztunnel server took its first snapshot
// (it runs in its own goroutine: "agent running" does not mean it has) and
// returns it.
func (h *harness) firstSnapshot() []ztunnel.SnapshotEntry {
	var first []ztunnel.SnapshotEntry
	h.waitFor("ztunnel server took its first snapshot", func() bool {
		h.zt.mu.Lock()
		defer h.zt.mu.Unlock()
		first = h.zt.firstSnap
		return h.zt.snapTaken
	})
	return first
}

func (h *harness) failures(reason string) float64 {
	h.t.Helper()
	var m dto.Metric
	if err := h.agent.metrics.failures.WithLabelValues(reason).Write(&m); err != nil {
		h.t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func (h *harness) condition(namespace, name string) *corev1.PodCondition {
	p, err := h.client.CoreV1().Pods(namespace).Get(h.t.Context(), name, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	return podCondition(p, podmeta.ConditionEnrolled)
}

func (h *harness) hasEvent(namespace, reason, contains string) bool {
	evs, err := h.client.CoreV1().Events(namespace).List(h.t.Context(), metav1.ListOptions{})
	if err != nil {
		return false
	}
	for _, e := range evs.Items {
		if e.Reason == reason && strings.Contains(e.Message, contains) {
			return true
		}
	}
	return false
}

func (h *harness) repairs(what string) float64 {
	h.t.Helper()
	var m dto.Metric
	if err := h.agent.metrics.repairs.WithLabelValues(what).Write(&m); err != nil {
		h.t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func namespace(name string, ambient bool) *corev1.Namespace {
	n := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if ambient {
		n.Labels = map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
	}
	return n
}

func pod(ns, name, uid string, ann map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), Annotations: ann},
		Spec:       corev1.PodSpec{NodeName: node, ServiceAccountName: "sa-" + name},
	}
}

// runningPod makes p a running pod with IP ip.
func runningPod(p *corev1.Pod, ip string) *corev1.Pod {
	p.Status.Phase = corev1.PodRunning
	p.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	return p
}

// netnsWith makes a real pod netns whose lo holds ips (and 127.0.0.1).
func netnsWith(t testing.TB, ips ...string) *testutil.NetNS {
	t.Helper()
	n := testutil.NewNetNS(t)
	err := n.NS.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		for _, s := range ips {
			ip := netip.MustParseAddr(s)
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())}}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}
