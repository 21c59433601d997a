//go:build e2enode

package e2enode

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

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

// containerStartedSince reports whether p's first container runs and
// started at or after t (seconds precision, as the API has it).
func containerStartedSince(p *corev1.Pod, t time.Time) bool {
	if len(p.Status.ContainerStatuses) == 0 {
		return false
	}
	r := p.Status.ContainerStatuses[0].State.Running
	return r != nil && !r.StartedAt.Time.Before(t.Truncate(time.Second))
}
