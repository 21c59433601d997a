package podstatus

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/test/infra/testutil"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/kubetest"
)

func pod(name, uid string, ann map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("u-" + uid), Annotations: ann}}
}

func annotation(t *testing.T, c *fake.Clientset, name string) (string, bool) {
	t.Helper()
	p, err := c.CoreV1().Pods("ns").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, ok := p.Annotations[podmeta.AnnotationRedirection]
	return v, ok
}

func start(t *testing.T, p *Patcher) {
	testutil.Run(t, func(ctx context.Context) error { p.Run(ctx, 2); return nil })
}

func TestSetRetriesUntilLanded(t *testing.T) {
	c := fake.NewClientset(pod("a", "1", nil))
	var fails atomic.Int32
	fails.Store(3)
	var sawStatus atomic.Bool
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() == "status" {
			sawStatus.Store(true)
		}
		if fails.Add(-1) >= 0 {
			return true, nil, apierrors.NewServiceUnavailable("apiserver down")
		}
		return false, nil, nil
	})
	var results sync.Map
	p := New(kubetest.Wrap(c), slog.New(slog.NewTextHandler(io.Discard, nil)), Options{BaseDelay: 5 * time.Millisecond, MaxDelay: 20 * time.Millisecond,
		OnResult: func(r Result, _ time.Duration) {
			n, _ := results.LoadOrStore(r, new(atomic.Int32))
			n.(*atomic.Int32).Add(1)
		}})
	start(t, p)
	p.Set("ns", "a", "u-1", Status{Redirection: "pending"})
	p.Set("ns", "a", "u-1", Status{Redirection: "enabled"}) // only the newest value matters
	testutil.WaitFor(t, "annotation enabled", func() bool { v, _ := annotation(t, c, "a"); return v == "enabled" && p.Pending() == 0 })
	if !sawStatus.Load() {
		t.Error("patch did not target the status subresource")
	}
	if n, _ := results.Load(ResultRetry); n == nil || n.(*atomic.Int32).Load() < 3 {
		t.Errorf("retries not reported: %v", n)
	}

	p.Set("ns", "a", "u-1", Status{Redirection: ""})
	testutil.WaitFor(t, "annotation removed", func() bool { _, ok := annotation(t, c, "a"); return !ok && p.Pending() == 0 })
}

func TestSetDropsGoneOrReplacedPod(t *testing.T) {
	c := fake.NewClientset(pod("b", "2", nil))
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.PatchAction).GetName() == "b" {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "b", errors.New("uid precondition"))
		}
		return false, nil, nil
	})
	p := New(kubetest.Wrap(c), slog.New(slog.NewTextHandler(io.Discard, nil)), Options{BaseDelay: time.Millisecond})
	start(t, p)
	p.Set("ns", "missing", "u-9", Status{Redirection: "enabled"})
	p.Set("ns", "b", "u-old", Status{Redirection: "enabled"})
	testutil.WaitFor(t, "writes dropped", func() bool { return p.Pending() == 0 })
	if _, ok := annotation(t, c, "b"); ok {
		t.Error("replaced pod got annotated")
	}
}

// TestSetForOldPodDoesNotReplaceNewPodsWrite: a StatefulSet pod recreated
// under the same name. A write for the old pod (its removal) queued after the
// new pod's `enabled` must not replace that write: the old one is dropped by
// the uid precondition, the new one lands.
func TestSetForOldPodDoesNotReplaceNewPodsWrite(t *testing.T) {
	c := fake.NewClientset(pod("web-0", "new", nil))
	// The fake clientset does not check metadata.uid; the API server does.
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		var body struct {
			Metadata struct {
				UID string `json:"uid"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(a.(k8stesting.PatchAction).GetPatch(), &body); err != nil {
			return true, nil, err
		}
		if body.Metadata.UID != "u-new" {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "web-0", errors.New("uid precondition"))
		}
		return false, nil, nil
	})
	p := New(kubetest.Wrap(c), slog.New(slog.NewTextHandler(io.Discard, nil)), Options{BaseDelay: time.Millisecond})
	p.Set("ns", "web-0", "u-new", Status{Redirection: "enabled"})
	p.Set("ns", "web-0", "u-old", Status{Redirection: ""}) // queued before any write runs
	start(t, p)
	testutil.WaitFor(t, "writes done", func() bool { return p.Pending() == 0 })
	if v, _ := annotation(t, c, "web-0"); v != "enabled" {
		t.Errorf("new pod's annotation %q, want enabled", v)
	}
	if v, ok := p.queued("ns", "web-0", "u-new"); ok {
		t.Errorf("write still queued after landing: %+v", v)
	}
}

// TestConditionInSameWrite: the annotation and the condition land in one
// pods/status patch, merged by condition type (kubelet's Ready stays).
func TestConditionInSameWrite(t *testing.T) {
	p := pod("c", "3", nil)
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	c := fake.NewClientset(p)
	var patches atomic.Int32
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		patches.Add(1)
		if pt := a.(k8stesting.PatchAction).GetPatchType(); pt != types.StrategicMergePatchType {
			t.Errorf("patch type %s, want strategic merge", pt)
		}
		return false, nil, nil
	})
	const ct = "ambient.istio.io/enrolled"
	pt := New(kubetest.Wrap(c), slog.New(slog.DiscardHandler), Options{BaseDelay: time.Millisecond, ConditionType: ct})
	start(t, pt)
	since := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	pt.Set("ns", "c", "u-3", Status{Redirection: "pending", Condition: Condition{Status: corev1.ConditionFalse, Reason: "Pending", Message: "waiting", Since: since}})
	testutil.WaitFor(t, "write landed", func() bool { return pt.Pending() == 0 })
	got, err := c.CoreV1().Pods("ns").Get(context.Background(), "c", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n := patches.Load(); n != 1 {
		t.Errorf("%d patches, want 1", n)
	}
	var ours, ready *corev1.PodCondition
	for i, cond := range got.Status.Conditions {
		switch cond.Type {
		case ct:
			ours = &got.Status.Conditions[i]
		case corev1.PodReady:
			ready = &got.Status.Conditions[i]
		}
	}
	if got.Annotations[podmeta.AnnotationRedirection] != "pending" || ours == nil || ours.Status != corev1.ConditionFalse ||
		ours.Reason != "Pending" || ours.Message != "waiting" || !ours.LastTransitionTime.Time.Equal(since) {
		t.Errorf("annotations %v, condition %+v: want pending and False/Pending since %v", got.Annotations, ours, since)
	}
	if ready == nil || ready.Status != corev1.ConditionTrue {
		t.Errorf("kubelet's Ready condition lost: %+v", got.Status.Conditions)
	}
	// Without a condition type nothing but the annotation is written.
	body, err := patchBody("u", "", Status{Redirection: "enabled", Condition: Condition{Status: corev1.ConditionTrue}})
	if err != nil || strings.Contains(string(body), "conditions") {
		t.Errorf("patch without condition type: %s, %v", body, err)
	}
}

// TestFlushWaitsForTheWrites: Flush returns once every queued write landed
// (here after two refused attempts), and with ctx's error when they cannot
// land in time.
func TestFlushWaitsForTheWrites(t *testing.T) {
	c := fake.NewClientset(pod("a", "1", nil), pod("b", "2", nil))
	var fails atomic.Int32
	fails.Store(2)
	c.PrependReactor("patch", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		if fails.Add(-1) >= 0 {
			return true, nil, errors.New("connection refused")
		}
		return false, nil, nil
	})
	p := New(kubetest.Wrap(c), slog.New(slog.DiscardHandler), Options{BaseDelay: 10 * time.Millisecond, ConditionType: podmeta.ConditionEnrolled})
	start(t, p)
	p.Set("ns", "a", "u-1", Status{Redirection: podmeta.RedirectionEnabled})
	p.Set("ns", "b", "u-2", Status{Redirection: podmeta.RedirectionPending})
	if err := p.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v, _ := annotation(t, c, "a"); v != podmeta.RedirectionEnabled {
		t.Errorf("a: annotation %q when Flush returned, want enabled", v)
	}
	if v, _ := annotation(t, c, "b"); v != podmeta.RedirectionPending {
		t.Errorf("b: annotation %q when Flush returned, want pending", v)
	}

	fails.Store(1 << 30) // the API refuses everything from now on
	p.Set("ns", "a", "u-1", Status{Redirection: podmeta.RedirectionPending})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := p.Flush(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Flush with writes that cannot land = %v, want the deadline", err)
	}
}

// A pod read from a watch cache that lags the agent's own write does not
// show it yet: LandedAfter says so only for the same status and a pod
// version older than the write's, so a hand edit after it is still healed.
func TestLandedAfter(t *testing.T) {
	p := New(nil, slog.New(slog.DiscardHandler), Options{})
	enabled := Status{Redirection: "enabled", Condition: Condition{Status: corev1.ConditionTrue, Reason: "Enrolled"}}
	p.mu.Lock()
	p.remember("u1", landedWrite{status: enabled, rv: "120", at: time.Now()})
	p.mu.Unlock()
	for _, c := range []struct {
		name, uid, rv string
		st            Status
		want          bool
	}{
		{"cache older than the write", "u1", "119", enabled, true},
		{"cache has the write", "u1", "120", enabled, false},
		{"someone wrote after us", "u1", "121", enabled, false},
		{"another status", "u1", "119", Status{Redirection: "pending"}, false},
		{"another pod", "u2", "119", enabled, false},
		{"versions that do not compare", "u1", "abc", enabled, false},
		{"no version", "u1", "", enabled, false},
	} {
		if got := p.LandedAfter(c.uid, c.rv, c.st); got != c.want {
			t.Errorf("%s: LandedAfter(%s, %s) = %v, want %v", c.name, c.uid, c.rv, got, c.want)
		}
	}
}

// TestFirstTrueLandsOnce: the mark of a pod's first True reaches OnWritten
// exactly once, with the pod as written: kept when a later write of the
// same status replaces it before it was sent, and not handed on to a
// later write once it was sent (in flight when the later one came).
func TestFirstTrueLandsOnce(t *testing.T) {
	enrolled := Status{Redirection: "enabled", Condition: Condition{Status: corev1.ConditionTrue, Reason: "Enrolled"}}
	first := enrolled
	first.FirstTrue = true
	c := fake.NewClientset(pod("a", "1", nil), pod("b", "2", nil))
	inFlight, release := make(chan struct{}), make(chan struct{})
	var blockB sync.Once
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.PatchAction).GetName() == "b" {
			blockB.Do(func() { close(inFlight); <-release }) // b's first write stays in flight
		}
		return false, nil, nil
	})
	var mu sync.Mutex
	marks := map[string]int{}
	writes := map[string]int{}
	p := New(kubetest.Wrap(c), slog.New(slog.NewTextHandler(io.Discard, nil)), Options{ConditionType: "ambient.istio.io/enrolled",
		OnWritten: func(st Status, pod *corev1.Pod) {
			mu.Lock()
			defer mu.Unlock()
			writes[pod.Name]++
			if st.FirstTrue {
				marks[pod.Name]++
			}
		}})
	// a: replaced by the same status before anything runs.
	p.Set("ns", "a", "u-1", first)
	p.Set("ns", "a", "u-1", enrolled)
	start(t, p)
	// b: the first write in flight, then the same status again.
	p.Set("ns", "b", "u-2", first)
	select {
	case <-inFlight:
	case <-time.After(30 * time.Second):
		t.Fatal("b's first write never sent")
	}
	p.Set("ns", "b", "u-2", enrolled)
	close(release)
	testutil.WaitFor(t, "every write landed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return p.Pending() == 0 && writes["b"] == 2
	})
	mu.Lock()
	defer mu.Unlock()
	if marks["a"] != 1 || marks["b"] != 1 {
		t.Errorf("first-True marks landed a=%d b=%d (writes %v), want 1 each", marks["a"], marks["b"], writes)
	}
}
