package kube

import (
	"context"
	"sync"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// InformerFactory makes the agent's shared informers, as client-go's
// SharedInformerFactory (informers.NewSharedInformerFactoryWithOptions)
// does for the resources here: one informer per resource, indexed by
// namespace, no resync, every list and watch passed through the factory's
// tweak (a field selector), started by Start and waited for by Shutdown.
type InformerFactory struct {
	client Interface
	tweak  func(*metav1.ListOptions)

	mu           sync.Mutex
	informers    map[string]cache.SharedIndexInformer
	started      map[string]bool
	shuttingDown bool
	wg           sync.WaitGroup
}

// NewInformerFactory returns a factory over client; tweak (may be nil)
// edits the options of every list and watch.
func NewInformerFactory(client Interface, tweak func(*metav1.ListOptions)) *InformerFactory {
	return &InformerFactory{client: client, tweak: tweak,
		informers: map[string]cache.SharedIndexInformer{}, started: map[string]bool{}}
}

// Pods returns the shared informer of pods (all namespaces, as tweaked).
func (f *InformerFactory) Pods() cache.SharedIndexInformer {
	return f.informerFor("pods", func() cache.SharedIndexInformer {
		return newInformer(f.client, f.client.CoreV1().Pods(metav1.NamespaceAll), f.tweak, &corev1.Pod{})
	})
}

// Namespaces returns the shared informer of namespaces.
func (f *InformerFactory) Namespaces() cache.SharedIndexInformer {
	return f.informerFor("namespaces", func() cache.SharedIndexInformer {
		return newInformer(f.client, f.client.CoreV1().Namespaces(), f.tweak, &corev1.Namespace{})
	})
}

// Nodes returns the shared informer of nodes.
func (f *InformerFactory) Nodes() cache.SharedIndexInformer {
	return f.informerFor("nodes", func() cache.SharedIndexInformer {
		return newInformer(f.client, f.client.CoreV1().Nodes(), f.tweak, &corev1.Node{})
	})
}

// RuntimeClasses returns the shared informer of RuntimeClasses.
func (f *InformerFactory) RuntimeClasses() cache.SharedIndexInformer {
	return f.informerFor("runtimeclasses", func() cache.SharedIndexInformer {
		return newInformer(f.client, f.client.NodeV1().RuntimeClasses(), f.tweak, &nodev1.RuntimeClass{})
	})
}

func (f *InformerFactory) informerFor(resource string, mk func() cache.SharedIndexInformer) cache.SharedIndexInformer {
	f.mu.Lock()
	defer f.mu.Unlock()
	if inf, ok := f.informers[resource]; ok {
		return inf
	}
	inf := mk()
	f.informers[resource] = inf
	return inf
}

// Start runs every informer made so far and not yet started, until stop
// is closed. It does nothing once Shutdown was called.
func (f *InformerFactory) Start(stop <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.shuttingDown {
		return
	}
	for resource, inf := range f.informers {
		if !f.started[resource] {
			f.wg.Go(func() { inf.Run(stop) })
			f.started[resource] = true
		}
	}
}

// Shutdown marks the factory as shutting down (Start does nothing after
// it) and waits until every started informer has returned: close the stop
// channel of Start first.
func (f *InformerFactory) Shutdown() {
	f.mu.Lock()
	f.shuttingDown = true
	f.mu.Unlock()
	f.wg.Wait()
}

// newInformer is a shared index informer of one resource, built as
// client-go's generated informers build theirs: a ListWatch over the typed
// client (with the watch-list semantics the client supports: a fake client
// says it has none), indexed by namespace.
func newInformer[L runtime.Object](client any, lw ListWatcher[L], tweak func(*metav1.ListOptions), example runtime.Object) cache.SharedIndexInformer {
	edit := func(o *metav1.ListOptions) {
		if tweak != nil {
			tweak(o)
		}
	}
	return cache.NewSharedIndexInformerWithOptions(
		cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				edit(&o)
				return lw.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				edit(&o)
				return lw.Watch(ctx, o)
			},
		}, client),
		example,
		cache.SharedIndexInformerOptions{Indexers: cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}},
	)
}

// Informers are the agent process's shared informers, made once (by
// nodeagent/daemon) and handed to every part that watches: this node's
// pods (the field selector keeps the cache small on big clusters), every
// namespace (their labels enroll pods), every RuntimeClass (the handler a
// pod runs under) and this node (its condition and taint). The parts add their handlers, transforms and indexers before
// Start; the owner starts them once and shuts them down after the last
// part stopped.
type Informers struct {
	Pods, Namespaces, RuntimeClasses, Node cache.SharedIndexInformer
	factories                              []*InformerFactory
}

// NewInformers makes the informers of nodeName's agent; nothing runs yet.
func NewInformers(client Interface, nodeName string) *Informers {
	pods := NewInformerFactory(client, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", nodeName).String()
	})
	all := NewInformerFactory(client, nil)
	node := NewInformerFactory(client, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", nodeName).String()
	})
	return &Informers{Pods: pods.Pods(), Namespaces: all.Namespaces(), RuntimeClasses: all.RuntimeClasses(), Node: node.Nodes(),
		factories: []*InformerFactory{pods, all, node}}
}

// Start runs every informer until stop is closed.
func (i *Informers) Start(stop <-chan struct{}) {
	for _, f := range i.factories {
		f.Start(stop)
	}
}

// Shutdown waits until every started informer has returned: close the
// stop channel of Start first.
func (i *Informers) Shutdown() {
	for _, f := range i.factories {
		f.Shutdown()
	}
}
