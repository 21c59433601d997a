package kube_test

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

func pod(ns, name, node string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: corev1.PodSpec{NodeName: node}}
}

// TestInformerFactory: one shared informer per resource; the factory's
// tweak (the agent's "pods of this node" field selector) is on every list
// and watch; the cache fills and follows changes, indexed by namespace;
// Shutdown returns once the informers stopped, and Start after it starts
// nothing.
func TestInformerFactory(t *testing.T) {
	cs := fake.NewClientset(pod("app", "web", "n1"), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}})
	var mu sync.Mutex
	selectors := map[string][]string{} // verb → field selectors seen
	cs.PrependReactor("list", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		selectors["list"] = append(selectors["list"], a.(k8stesting.ListAction).GetListRestrictions().Fields.String())
		return false, nil, nil
	})
	cs.PrependWatchReactor("pods", func(a k8stesting.Action) (bool, watch.Interface, error) {
		mu.Lock()
		defer mu.Unlock()
		selectors["watch"] = append(selectors["watch"], a.(k8stesting.WatchAction).GetWatchRestrictions().Fields.String())
		return false, nil, nil
	})
	f := kube.NewInformerFactory(kubetest.Wrap(cs), func(o *metav1.ListOptions) { o.FieldSelector = "spec.nodeName=n1" })
	pods := f.Pods()
	if f.Pods() != pods {
		t.Fatal("Pods() made a second informer; want the shared one")
	}
	nss := f.Namespaces()
	ctx, cancel := context.WithCancel(context.Background())
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), pods.HasSynced, nss.HasSynced) {
		t.Fatal("caches never synced")
	}
	if _, ok, _ := pods.GetIndexer().GetByKey("app/web"); !ok {
		t.Fatal("pod app/web not in the cache")
	}
	if _, err := cs.CoreV1().Pods("app").Create(ctx, pod("app", "db", "n1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the new pod in the namespace index", 10*time.Second, func() bool {
		objs, err := pods.GetIndexer().ByIndex(cache.NamespaceIndex, "app")
		return err == nil && len(objs) == 2
	})
	mu.Lock()
	for _, verb := range []string{"list", "watch"} {
		if len(selectors[verb]) == 0 {
			t.Errorf("no %s of pods", verb)
		}
		for _, s := range selectors[verb] {
			if s != "spec.nodeName=n1" {
				t.Errorf("%s of pods with field selector %q, want the tweak's spec.nodeName=n1", verb, s)
			}
		}
	}
	mu.Unlock()

	cancel()
	shutdown(t, f, "after the stop channel closed")
	// An informer started now, with a stop channel never closed, would
	// keep a second Shutdown waiting forever.
	f.Nodes()
	f.Start(make(chan struct{}))
	shutdown(t, f, "a second time, after a Start that should have started nothing")
}

func shutdown(t *testing.T, f *kube.InformerFactory, when string) {
	t.Helper()
	done := make(chan struct{})
	go func() { f.Shutdown(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("Shutdown did not return %s", when)
	}
}
