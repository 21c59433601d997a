// Package agent is the node agent's core: it watches this node's pods and all
// namespaces, decides with the enrollment policy which pods belong in the mesh,
// and drives each pod to its wanted state — rules in its network namespace,
// ztunnel told, probe IPs registered, annotation written — through one
// idempotent reconcile per pod fed by a rate-limited workqueue (the
// sample-controller shape). It also implements the CNI server's Handler, so a
// new pod is enrolled before its containers start.
//
// The agent holds no package-level state; everything lives in an Agent.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/policy"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// Ztunnel is what the agent needs from the ztunnel server
// (*ztunnel.Server implements it).
type Ztunnel interface {
	AddWorkload(ctx context.Context, w ztunnel.Workload, netns *os.File) error
	DelWorkload(ctx context.Context, uid string) error
	SubscribeSnapshotAcked() (<-chan struct{}, func())
	Status() ztunnel.Status
	Run(ctx context.Context) error
}

// Rules is what the agent needs from the rule manager (*iptables.Manager
// implements it).
type Rules interface {
	ApplyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) error
	DeletePod(ctx context.Context, podNS ns.NetNS) error
	AddProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error
	RemoveProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error
}

// CNIServer is the CNI event server (*cniserver.Server implements it). It is
// created after the agent, because the agent is its Handler.
type CNIServer interface {
	Run(ctx context.Context) error
	Serving() bool
}

// Config configures an Agent. Zero durations take the defaults in brackets.
type Config struct {
	NodeName string
	Policy   policy.Config
	// Rules is the node-wide rule configuration; per-pod options are derived
	// from it and the pod's annotations.
	Rules iptables.Config
	// HostProc is the host's /proc, scanned for running pods' netns [/proc].
	HostProc string
	// FailPending makes a CNI ADD fail when the pod's rules are in place but
	// ztunnel did not ack it (the rules are then removed again). By default
	// such a pod starts: its traffic is captured and held by the redirect until
	// ztunnel takes the pod over.
	FailPending bool
	// PodLookupTimeout bounds how long a CNI ADD waits for a pod the API does
	// not know yet [10s]. CacheWait is the first part of it, during which only
	// the informer cache is consulted [500ms].
	PodLookupTimeout, CacheWait time.Duration
	// RetryBaseDelay..RetryMaxDelay is the per-pod backoff of failed
	// reconciles, including pending pods [200ms..30s].
	RetryBaseDelay, RetryMaxDelay time.Duration
	// Workers reconcile pods concurrently [4].
	Workers int
	// HealthAddr serves /healthz and /readyz; MetricsAddr serves /metrics.
	// Empty disables the listener.
	HealthAddr, MetricsAddr string
	// Collectors are registered with the agent's metrics (e.g. the ztunnel
	// server's).
	Collectors []prometheus.Collector
}

func (c Config) withDefaults() Config {
	if c.HostProc == "" {
		c.HostProc = "/proc"
	}
	if c.PodLookupTimeout <= 0 {
		c.PodLookupTimeout = 10 * time.Second
	}
	if c.CacheWait <= 0 {
		c.CacheWait = 500 * time.Millisecond
	}
	if c.RetryBaseDelay <= 0 {
		c.RetryBaseDelay = 200 * time.Millisecond
	}
	if c.RetryMaxDelay <= 0 {
		c.RetryMaxDelay = 30 * time.Second
	}
	if c.Workers <= 0 {
		c.Workers = 4
	}
	return c
}

// Agent is the node agent. Create with New, then Run.
type Agent struct {
	cfg     Config
	client  kubernetes.Interface
	log     *slog.Logger
	zt      Ztunnel
	rules   Rules
	reg     *registry.Registry
	finder  *podnetns.Finder
	status  *podstatus.Patcher
	metrics *metrics

	podFactory, nsFactory informers.SharedInformerFactory
	podInformer           cache.SharedIndexInformer
	nsInformer            cache.SharedIndexInformer
	nsLister              corelisters.NamespaceLister
	queue                 workqueue.TypedRateLimitingInterface[string] // pod uids

	locks keyedMutex

	synced     atomic.Bool // informer caches synced
	running    atomic.Bool // rebuild done, servers and workers started
	liveLoops  atomic.Int32
	wantLoops  int32
	cniServing func() bool
}

const uidIndex = "uid"

// New builds an agent. reg is the registry the ztunnel server takes its
// snapshots from (see SnapshotSource); the agent owns it from now on.
func New(cfg Config, client kubernetes.Interface, zt Ztunnel, rules Rules, reg *registry.Registry, log *slog.Logger) (*Agent, error) {
	cfg = cfg.withDefaults()
	if cfg.NodeName == "" {
		return nil, errors.New("agent: node name is required")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Agent{
		cfg:    cfg,
		client: client,
		log:    log.With("component", "agent"),
		zt:     zt,
		rules:  rules,
		reg:    reg,
		finder: podnetns.New(cfg.HostProc),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.RetryBaseDelay, cfg.RetryMaxDelay),
			workqueue.TypedRateLimitingQueueConfig[string]{}),
	}
	a.metrics = newMetrics(reg)
	a.status = podstatus.New(client, log.With("component", "podstatus"), podstatus.Options{
		OnResult: func(r podstatus.Result) { a.metrics.annotations.WithLabelValues(string(r)).Inc() },
	})

	// Pods of this node only: the field selector keeps the cache small on
	// big clusters. Namespaces: all (their labels enroll pods).
	a.podFactory = informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName).String()
		}))
	a.nsFactory = informers.NewSharedInformerFactory(client, 0)
	a.podInformer = a.podFactory.Core().V1().Pods().Informer()
	if err := a.podInformer.AddIndexers(cache.Indexers{uidIndex: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok {
			return []string{string(p.UID)}, nil
		}
		return nil, nil
	}}); err != nil {
		return nil, fmt.Errorf("agent: add pod uid index: %w", err)
	}
	a.metrics.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "ambientd_informer_pods",
		Help: "Pods of this node in the agent's informer cache.",
	}, func() float64 { return float64(len(a.podInformer.GetStore().ListKeys())) }))
	a.nsInformer = a.nsFactory.Core().V1().Namespaces().Informer()
	a.nsLister = a.nsFactory.Core().V1().Namespaces().Lister()

	// Event handlers only enqueue keys; all decisions happen in reconcile.
	if _, err := a.podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    a.enqueuePod,
		UpdateFunc: func(_, obj any) { a.enqueuePod(obj) },
		DeleteFunc: a.enqueuePod,
	}); err != nil {
		return nil, fmt.Errorf("agent: pod event handler: %w", err)
	}
	if _, err := a.nsInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: a.enqueueNamespace,
		UpdateFunc: func(old, obj any) {
			o, n := old.(*corev1.Namespace), obj.(*corev1.Namespace)
			if o.Labels[policy.LabelDataplaneMode] != n.Labels[policy.LabelDataplaneMode] {
				a.enqueueNamespace(obj)
			}
		},
	}); err != nil {
		return nil, fmt.Errorf("agent: namespace event handler: %w", err)
	}
	return a, nil
}

// Registry returns the agent's pod registry (read-only use).
func (a *Agent) Registry() *registry.Registry { return a.reg }

func (a *Agent) enqueuePod(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	if p, ok := obj.(*corev1.Pod); ok {
		a.queue.Add(string(p.UID))
	}
}

func (a *Agent) enqueueNamespace(obj any) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return
	}
	pods, err := a.podInformer.GetIndexer().ByIndex(cache.NamespaceIndex, n.Name)
	if err != nil {
		return
	}
	for _, p := range pods {
		a.enqueuePod(p)
	}
}

// Run starts the informers, waits for their caches, rebuilds the registry
// from the API and /proc (so a restarted agent's first ztunnel snapshot holds
// every live pod), and only then serves the ztunnel and CNI sockets and starts
// the workers. It returns when ctx ends (nil) or a server fails.
func (a *Agent) Run(ctx context.Context, cni CNIServer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	a.cniServing = cni.Serving
	defer a.reg.Close()

	errc := make(chan error, 8)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	fail := func(what string, err error) {
		if err != nil && ctx.Err() == nil {
			errc <- fmt.Errorf("%s: %w", what, err)
		}
	}

	if err := a.serveHTTP(ctx, &wg, fail); err != nil {
		return err
	}

	a.podFactory.Start(ctx.Done())
	a.nsFactory.Start(ctx.Done())
	// Shutdown waits for the informers, which stop only once ctx is
	// cancelled: cancel first, whichever way Run returns.
	defer func() {
		cancel()
		a.podFactory.Shutdown()
		a.nsFactory.Shutdown()
	}()
	a.log.Info("waiting for informer caches", "node", a.cfg.NodeName)
	if !cache.WaitForCacheSync(ctx.Done(), a.podInformer.HasSynced, a.nsInformer.HasSynced) {
		return nil // ctx ended before the caches synced: a clean stop
	}
	a.synced.Store(true)

	a.rebuild(ctx)

	acked, unsubscribe := a.zt.SubscribeSnapshotAcked()
	defer unsubscribe()
	a.wantLoops = int32(a.cfg.Workers) + 1
	// Loops count as live from before they start, so /healthz never sees a
	// loop "missing" that simply has not been scheduled yet; each one takes
	// itself off the count when it returns.
	a.liveLoops.Add(a.wantLoops)
	wg.Go(func() { fail("ztunnel server", a.zt.Run(ctx)) })
	wg.Go(func() { fail("CNI server", cni.Run(ctx)) })
	wg.Go(func() { a.status.Run(ctx, 2) })
	wg.Go(func() { a.retryOnSnapshotAck(ctx, acked) })
	for range a.cfg.Workers {
		wg.Go(func() { a.worker(ctx) })
	}
	context.AfterFunc(ctx, a.queue.ShutDown)
	a.running.Store(true)
	a.log.Info("agent running", "node", a.cfg.NodeName, "pods", a.reg.Len())

	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		a.log.Error("agent stopping", "error", err)
		return err
	}
}

// retryOnSnapshotAck retries every pending pod as soon as a ztunnel acks its
// snapshot: the pod may have been sent as Add in the snapshot, but the server
// does not report per-pod results, so a fresh Add (a no-op for ztunnel if it
// already has the pod) is what proves the pod is taken over.
func (a *Agent) retryOnSnapshotAck(ctx context.Context, acked <-chan struct{}) {
	defer a.liveLoops.Add(-1)
	for {
		select {
		case <-ctx.Done():
			return
		case <-acked:
			pending := a.reg.UIDs(registry.Pending)
			if len(pending) > 0 {
				a.log.Info("ztunnel snapshot acked, retrying pending pods", "pending", len(pending))
			}
			for _, uid := range pending {
				a.queue.Add(uid)
			}
		}
	}
}

func (a *Agent) worker(ctx context.Context) {
	defer a.liveLoops.Add(-1)
	for {
		uid, quit := a.queue.Get()
		if quit {
			return
		}
		err := a.reconcile(ctx, uid)
		switch {
		case err == nil:
			a.queue.Forget(uid)
		case ctx.Err() != nil:
			a.queue.Forget(uid)
		default:
			a.queue.AddRateLimited(uid)
		}
		a.queue.Done(uid)
	}
}

// keyedMutex serialises work on one pod (CNI ADD/DEL and reconcile) without
// blocking other pods. Entries are dropped when unused.
type keyedMutex struct {
	mu sync.Mutex
	m  map[string]*keyedEntry
}

type keyedEntry struct {
	mu   sync.Mutex
	refs int
}

func (k *keyedMutex) lock(key string) func() {
	k.mu.Lock()
	if k.m == nil {
		k.m = make(map[string]*keyedEntry)
	}
	e := k.m[key]
	if e == nil {
		e = &keyedEntry{}
		k.m[key] = e
	}
	e.refs++
	k.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		k.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
}
