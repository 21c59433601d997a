package repair

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stest "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

const node = "node-a"

// pod is a sidecar pod on node whose istio-validation is in state st with
// last termination last.
func pod(name string, mut ...func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "demo", UID: types.UID("uid-" + name), ResourceVersion: "7",
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}, Labels: map[string]string{"app": "a"}},
		Spec: corev1.PodSpec{NodeName: node},
		Status: corev1.PodStatus{Phase: corev1.PodPending, InitContainerStatuses: []corev1.ContainerStatus{{
			Name:                 "istio-validation",
			State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
			LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Message: "iptables validation failed"}},
		}}},
	}
	for _, m := range mut {
		m(p)
	}
	return p
}

func TestBroken(t *testing.T) {
	tests := []struct {
		name string
		pod  *corev1.Pod
		cfg  func(*Config)
		want bool
	}{
		{"validation failed with 126, restarting", pod("a"), nil, true},
		{"first failure, not restarted yet (Istio matches the last termination only)", pod("a", func(p *corev1.Pod) {
			s := &p.Status.InitContainerStatuses[0]
			s.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126}}
			s.LastTerminationState = corev1.ContainerState{}
		}), nil, false},
		{"passed since", pod("a", func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed"}}
		}), nil, false},
		{"other exit code", pod("a", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].LastTerminationState.Terminated.ExitCode = 1 }), nil, false},
		{"any exit code configured", pod("a", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].LastTerminationState.Terminated.ExitCode = 1 }),
			func(c *Config) { c.InitExitCode = 0 }, true},
		{"message must match", pod("a"), func(c *Config) { c.InitTerminationMessage = "something else" }, false},
		{"message matches", pod("a"), func(c *Config) { c.InitTerminationMessage = " iptables validation failed " }, true},
		{"no sidecar annotation", pod("a", func(p *corev1.Pod) { delete(p.Annotations, "sidecar.istio.io/status") }), nil, false},
		{"other init container", pod("a", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].Name = "init" }), nil, false},
		{"other node", pod("a", func(p *corev1.Pod) { p.Spec.NodeName = "node-b" }), nil, false},
		{"label selector excludes", pod("a"), func(c *Config) { c.LabelSelector = "app=b" }, false},
		{"field selector selects", pod("a"), func(c *Config) { c.FieldSelector = "metadata.namespace=demo" }, true},
		{"field selector excludes", pod("a"), func(c *Config) { c.FieldSelector = "metadata.namespace!=demo" }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.NodeName = node
			cfg.Mode = ModeDelete
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			c, _, _ := newController(t, cfg, nil)
			if got := c.Broken(tt.pod); got != tt.want {
				t.Errorf("Broken = %v, want %v", got, tt.want)
			}
		})
	}
}

type fakeRepairer struct {
	mu    sync.Mutex
	calls []string
	err   error
}

func (f *fakeRepairer) Repair(_ context.Context, p *corev1.Pod) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, p.Name)
	return f.err
}

func (f *fakeRepairer) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

func (f *fakeRepairer) called() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

// fence creates the broken pod name and waits for its repair. The
// controller's one worker takes keys in the order the informer delivered
// them, and the informer delivers events in the order they happened: once
// the fence is repaired, every event before its creation has been handled.
// (Two fences around an update: the first makes sure an earlier sync of the
// updated pod has finished, so the update is queued rather than folded into
// that sync.)
func fence(t *testing.T, client *fake.Clientset, r *fakeRepairer, name string) {
	t.Helper()
	if _, err := client.CoreV1().Pods("demo").Create(t.Context(), pod(name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, name+" repaired (every earlier event handled)", func() bool { return slices.Contains(r.called(), name) })
}

func newController(t *testing.T, cfg Config, r Repairer, pods ...*corev1.Pod) (*Controller, *fake.Clientset, *record.FakeRecorder) {
	t.Helper()
	client := fake.NewClientset()
	for _, p := range pods {
		if _, err := client.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	inf := informers.NewSharedInformerFactory(client, 0).Core().V1().Pods().Informer()
	rec := record.NewFakeRecorder(100)
	if r == nil {
		r = &fakeRepairer{}
	}
	c, err := New(cfg, kubetest.Wrap(client), inf, r, rec, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go inf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		t.Fatal("no sync")
	}
	return c, client, rec
}

func run(t *testing.T, c *Controller) { testutil.Run(t, c.Run) }

func event(t *testing.T, rec *record.FakeRecorder, want string) {
	t.Helper()
	select {
	case e := <-rec.Events:
		if !strings.Contains(e, want) {
			t.Errorf("Event %q, want one with %q", e, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("no Event %q", want)
	}
}

// TestRepairMode: a broken pod has its rules programmed once (the
// repairer), counted, with an Event; a healthy pod and a pod of another
// node are left alone; a failing repair is retried, at most MaxAttempts.
func TestRepairMode(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeName = node
	r := &fakeRepairer{}
	healthy := pod("healthy", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].LastTerminationState = corev1.ContainerState{} })
	elsewhere := pod("elsewhere", func(p *corev1.Pod) { p.Spec.NodeName = "node-b" })
	c, client, rec := newController(t, cfg, r, pod("broken"), healthy, elsewhere)
	run(t, c)
	testutil.WaitFor(t, "the repair", func() bool { return r.count() == 1 })
	event(t, rec, EventRepairBrokenPod)
	if got := promtest.ToFloat64(c.repaired.WithLabelValues("repair", "success")); got != 1 {
		t.Errorf("metric repair/success = %v", got)
	}
	// An update of the pod (kubelet restarts the init container) does not
	// repair it again. The fences make sure the controller has handled the
	// update before the test looks.
	fence(t, client, r, "fence-before")
	p, _ := client.CoreV1().Pods("demo").Get(t.Context(), "broken", metav1.GetOptions{})
	p.Status.InitContainerStatuses[0].RestartCount = 2
	if _, err := client.CoreV1().Pods("demo").UpdateStatus(t.Context(), p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	fence(t, client, r, "fence-after")
	if got, want := r.called(), []string{"broken", "fence-before", "fence-after"}; !slices.Equal(got, want) {
		t.Errorf("repaired %v, want %v (broken once, the healthy pod and the other node's never)", got, want)
	}

	failing := &fakeRepairer{err: errors.New("no netns")}
	cfg.MaxAttempts = 3
	c2, _, _ := newController(t, cfg, failing, pod("broken"))
	run(t, c2)
	// Given up: the third failure forgot the key (no retry is queued).
	broken := types.NamespacedName{Namespace: "demo", Name: "broken"}
	testutil.WaitFor(t, "three attempts, then given up", func() bool { return failing.count() == 3 && c2.queue.NumRequeues(broken) == 0 })
	if n := failing.count(); n != 3 {
		t.Errorf("%d attempts, want 3 (MaxAttempts)", n)
	}
	if got := promtest.ToFloat64(c2.repaired.WithLabelValues("repair", "fail")); got != 3 {
		t.Errorf("metric repair/fail = %v", got)
	}
}

// TestDeleteMode: a broken pod is deleted, with UID and resourceVersion
// preconditions, the Event DeleteBrokenPod and the metric; a healthy one
// is kept.
func TestDeleteMode(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeName, cfg.Mode = node, ModeDelete
	healthy := pod("healthy", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].LastTerminationState = corev1.ContainerState{} })
	c, client, rec := newController(t, cfg, nil, pod("broken"), healthy)
	var pre *metav1.Preconditions
	client.PrependReactor("delete", "pods", func(a k8stest.Action) (bool, runtime.Object, error) {
		pre = a.(k8stest.DeleteAction).GetDeleteOptions().Preconditions
		return false, nil, nil
	})
	run(t, c)
	testutil.WaitFor(t, "the delete", func() bool {
		_, err := client.CoreV1().Pods("demo").Get(context.Background(), "broken", metav1.GetOptions{})
		return err != nil
	})
	event(t, rec, EventDeleteBrokenPod+" pod detected as broken, deleted")
	if pre == nil || pre.UID == nil || *pre.UID != "uid-broken" || pre.ResourceVersion == nil || *pre.ResourceVersion != "7" {
		t.Errorf("delete preconditions %+v, want uid and resourceVersion", pre)
	}
	if _, err := client.CoreV1().Pods("demo").Get(context.Background(), "healthy", metav1.GetOptions{}); err != nil {
		t.Errorf("healthy pod: %v", err)
	}
	if got := promtest.ToFloat64(c.repaired.WithLabelValues("delete", "success")); got != 1 {
		t.Errorf("metric delete/success = %v", got)
	}
}

// TestLabelMode: a broken pod gets the label through the status
// subresource (the only pod write the admission policy allows), with the
// Event LabelBrokenPod; one already labelled is skipped.
func TestLabelMode(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeName, cfg.Mode = node, ModeLabel
	labelled := pod("labelled", func(p *corev1.Pod) { p.Labels[cfg.LabelKey] = "true" })
	c, client, rec := newController(t, cfg, nil, pod("broken"), labelled)
	var subresources []string
	client.PrependReactor("patch", "pods", func(a k8stest.Action) (bool, runtime.Object, error) {
		subresources = append(subresources, a.GetSubresource())
		return false, nil, nil
	})
	run(t, c)
	testutil.WaitFor(t, "the label", func() bool {
		p, err := client.CoreV1().Pods("demo").Get(context.Background(), "broken", metav1.GetOptions{})
		return err == nil && p.Labels["cni.istio.io/uninitialized"] == "true"
	})
	event(t, rec, EventLabelBrokenPod+" pod detected as broken, labeled")
	testutil.WaitFor(t, "the skip of the labelled pod", func() bool { return promtest.ToFloat64(c.repaired.WithLabelValues("label", "skip")) >= 1 })
	if len(subresources) != 1 || subresources[0] != "status" {
		t.Errorf("patched subresources %q, want one patch of status", subresources)
	}
}

func TestParseMode(t *testing.T) {
	for _, s := range []string{"repair", "delete", "label", "off"} {
		if _, err := ParseMode(s); err != nil {
			t.Errorf("%s: %v", s, err)
		}
	}
	if _, err := ParseMode("fix"); err == nil {
		t.Error("fix accepted")
	}
}

var errNotSidecar = errors.New("not a sidecar pod")

// skippingRepairer refuses every pod as not to be captured.
type skippingRepairer struct{ fakeRepairer }

func (s *skippingRepairer) Skip() error { return errNotSidecar }

// TestRepairModeSkipsPodsNotToCapture: a broken pod the repairer says is
// not to be captured (Istio's skip order: inject=false, a gateway, ...) is
// counted as skipped, once, and not retried.
func TestRepairModeSkipsPodsNotToCapture(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeName = node
	r := &skippingRepairer{fakeRepairer{err: fmt.Errorf("pod demo/broken: %w", errNotSidecar)}}
	c, _, _ := newController(t, cfg, r, pod("broken"))
	run(t, c)
	// Skipped: the key is forgotten (no retry is queued).
	broken := types.NamespacedName{Namespace: "demo", Name: "broken"}
	testutil.WaitFor(t, "the skip", func() bool {
		return promtest.ToFloat64(c.repaired.WithLabelValues("repair", "skip")) == 1 && c.queue.NumRequeues(broken) == 0
	})
	if n := r.count(); n != 1 {
		t.Errorf("asked %d times, want once (no retry)", n)
	}
	if got := promtest.ToFloat64(c.repaired.WithLabelValues("repair", "fail")); got != 0 {
		t.Errorf("counted as failed %v times", got)
	}
}
