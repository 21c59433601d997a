package sidecar_test

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/policy"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
	tu "github.com/ambientd/ambientd/test/infra/testutil"
)

const testNode = "node-a"

// sidecarPod is a golden injected pod running on testNode with uid.
func sidecarPod(t testing.TB, name, uid string) (*corev1.Pod, istiogolden.Case) {
	t.Helper()
	c, err := istiogolden.LoadCase(name)
	if err != nil {
		t.Fatal(err)
	}
	p := c.Injected.DeepCopy()
	p.UID = types.UID(uid)
	p.Name = name
	p.Spec.NodeName = testNode
	p.Status.Phase = corev1.PodRunning
	for _, ip := range c.IPs() {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip.String()})
	}
	return p, c
}

// fakeProc is a /proc with one "process" per pod: its cgroup names the pod
// uid and its ns/net is the pod's namespace (what podnetns.Finder reads).
func fakeProc(t *testing.T, pods map[string]ns.NetNS) string {
	t.Helper()
	dir := t.TempDir()
	pid := 100
	for uid, n := range pods {
		p := filepath.Join(dir, strconv.Itoa(pid))
		pid++
		if err := os.MkdirAll(filepath.Join(p, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p, "cgroup"), []byte("0::/kubepods/besteffort/pod"+uid+"/abc\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(n.Path(), filepath.Join(p, "ns", "net")); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// captureAt is sidecar mode's part of a CNI ADD as the agent's CNI edge
// runs it: the netns at path opened, the pod captured there, the handle
// closed (the tracker keeps no descriptor).
func captureAt(ctx context.Context, tr *sidecar.Tracker, pod *corev1.Pod, path string, ips []netip.Addr) error {
	h, err := podnetns.Open(path)
	if err != nil {
		return err
	}
	defer h.Close()
	return tr.Capture(ctx, pod, h, ips)
}

type trackerEnv struct {
	tr       *sidecar.Tracker
	events   *record.FakeRecorder
	reg      *prometheus.Registry
	informer cache.SharedIndexInformer
}

func newTracker(t testing.TB, m *iptables.Manager, hostProc string, pods ...*corev1.Pod) trackerEnv {
	t.Helper()
	client := fake.NewClientset()
	for _, p := range pods {
		if _, err := client.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	f := informers.NewSharedInformerFactory(client, 0)
	inf := f.Core().V1().Pods().Informer()
	env := trackerEnv{events: record.NewFakeRecorder(100), reg: prometheus.NewRegistry(), informer: inf}
	tr, err := sidecar.New(sidecar.Config{NodeName: testNode, Policy: policy.DefaultConfig(), HostProc: hostProc}, m, inf, env.events, env.reg, tu.Logger(t, -4))
	if err != nil {
		t.Fatal(err)
	}
	env.tr = tr
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		t.Fatal("informer did not sync")
	}
	return env
}

func (e trackerEnv) metric(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			var sum float64
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
			return sum
		}
	}
	return 0
}

func (e trackerEnv) event(t *testing.T, reason string) string {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case ev := <-e.events.Events:
			if strings.Contains(ev, " "+reason+" ") {
				return ev
			}
		case <-deadline:
			t.Fatalf("no %s Event", reason)
		}
	}
}

// breakRules removes one of the pod's capture rules behind the agent's back
// (the outbound redirect), as a stray iptables or nft command would.
func breakRules(t *testing.T, n ns.NetNS, mode iptables.Mode) {
	t.Helper()
	if mode == iptables.ModeNFTables {
		nsRun(t, n, "", "nft", "flush", "chain", "inet", iptables.NFTTableSidecarNat, "istio-redirect")
		return
	}
	nsRun(t, n, "", "iptables-"+string(mode), "-t", "nat", "-F", iptables.ChainSidecarRedirect)
}

// TestTrackerCaptureDriftRestart: on every backend, a sidecar pod captured
// at CNI ADD is tracked and verifies clean; an intact pod is not written by
// the drift pass; a rule removed behind the agent's back is named, repaired,
// counted (ambientd_sidecar_repairs_total) and recorded (Event
// RulesRepaired); after a restart (a new Tracker, nothing tracked) the pod
// is found by the /proc scan, its drift repaired and it is tracked again; a
// pod whose sandbox is gone is forgotten.
func TestTrackerCaptureDriftRestart(t *testing.T) {
	tu.RequireIptables(t, "nft")
	ctx := testCtx(t)
	for _, mode := range allModes {
		t.Run(string(mode), func(t *testing.T) {
			m := newManager(t, mode)
			pod, c := sidecarPod(t, "dns-capture", "uid-"+string(mode))
			n := podWithAddrs(t, c)
			env := newTracker(t, m, fakeProc(t, map[string]ns.NetNS{string(pod.UID): n}), pod)
			if err := captureAt(ctx, env.tr, pod, n.Path(), c.IPs()); err != nil {
				t.Fatal(err)
			}
			opts, ok := env.tr.Tracked(string(pod.UID))
			if !ok {
				t.Fatal("captured pod not tracked")
			}
			if d, err := m.VerifySidecar(ctx, n, opts); err != nil || !d.Empty() {
				t.Fatalf("after capture: %v %s", err, d)
			}
			before := listing(t, n, mode)
			env.tr.VerifyPass(ctx)
			if got := env.metric(t, "ambientd_sidecar_repairs_total"); got != 0 {
				t.Errorf("intact pod repaired %v times", got)
			}
			if listing(t, n, mode) != before {
				t.Error("the drift pass rewrote an intact pod")
			}

			breakRules(t, n, mode)
			if d, _ := m.VerifySidecar(ctx, n, opts); d.Empty() {
				t.Fatal("removed rule not seen by verify")
			}
			env.tr.VerifyPass(ctx)
			if d, err := m.VerifySidecar(ctx, n, opts); err != nil || !d.Empty() {
				t.Errorf("after the drift pass: %v %s", err, d)
			}
			if got := env.metric(t, "ambientd_sidecar_repairs_total"); got != 1 {
				t.Errorf("repairs counted %v, want 1", got)
			}
			env.event(t, sidecar.EventRulesRepaired)

			// Restart: a new tracker knows nothing; Rebuild finds the pod
			// and repairs it.
			breakRules(t, n, mode)
			restarted := newTracker(t, m, fakeProc(t, map[string]ns.NetNS{string(pod.UID): n}), pod)
			restarted.tr.Rebuild(ctx)
			if _, ok := restarted.tr.Tracked(string(pod.UID)); !ok {
				t.Fatal("restart: pod not tracked again")
			}
			if d, err := m.VerifySidecar(ctx, n, opts); err != nil || !d.Empty() {
				t.Errorf("restart: not repaired: %v %s", err, d)
			}
			if got := restarted.metric(t, "ambientd_sidecar_repairs_total"); got != 1 {
				t.Errorf("restart: repairs counted %v, want 1", got)
			}
			restarted.event(t, sidecar.EventRulesRepaired)
		})
	}
}

// TestTrackerForgetsGoneSandbox: the tracker holds no descriptor of a
// pod's namespace (so the namespace, and its rules, go with the sandbox):
// once the namespace is gone, the drift pass forgets the pod.
func TestTrackerForgetsGoneSandbox(t *testing.T) {
	tu.RequireIptables(t, "nft")
	ctx := testCtx(t)
	m := newManager(t, iptables.ModeNFTables)
	pod, c := sidecarPod(t, "redirect-default", "uid-gone")
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	env := newTracker(t, m, t.TempDir(), pod)
	if err := captureAt(ctx, env.tr, pod, n.Path(), c.IPs()); err != nil {
		t.Fatal(err)
	}
	n.Close()
	if err := testutils.UnmountNS(n); err != nil {
		t.Fatal(err)
	}
	env.tr.VerifyPass(ctx)
	if _, ok := env.tr.Tracked(string(pod.UID)); ok {
		t.Error("a pod whose sandbox is gone is still tracked")
	}
}

// TestTrackerInvalidAnnotation: an invalid sidecar annotation fails the
// capture with Istio's error, writes no rule and records an Event.
func TestTrackerInvalidAnnotation(t *testing.T) {
	tu.RequireIptables(t, "nft")
	ctx := testCtx(t)
	m := newManager(t, iptables.ModeLegacy)
	pod, c := sidecarPod(t, "error-port-out-of-range", "uid-bad")
	n := tu.NewNetNS(t).NS
	env := newTracker(t, m, t.TempDir(), pod)
	err := captureAt(ctx, env.tr, pod, n.Path(), c.IPs())
	if !errors.Is(err, sidecar.ErrInvalidAnnotation) || !strings.Contains(err.Error(), c.Error) {
		t.Fatalf("capture error %v, want ErrInvalidAnnotation with %q", err, c.Error)
	}
	if l := listing(t, n, iptables.ModeLegacy); strings.Contains(l, "ISTIO") {
		t.Errorf("rules written for an invalid pod:\n%s", l)
	}
	env.event(t, sidecar.EventCaptureFailed)
	if got := env.metric(t, "ambientd_sidecar_adds_total"); got != 1 {
		t.Errorf("adds{invalid_annotation} = %v", got)
	}
}
