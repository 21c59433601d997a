// Package agent is the node agent's core: it watches this node's pods and all
// namespaces, decides with the enrollment policy which pods belong in the mesh,
// and drives each pod through its lifecycle phases (see registry.Phase) —
// rules in its network namespace, ztunnel told, probe IPs registered, status
// written — with one per-pod sync used by the workqueue and by CNI ADD alike
// (the sample-controller shape). It knows no transport: it returns domain
// errors (ErrPodUnknown, …) that the CNI server maps to gRPC codes, and it
// supervises no listener: nodeagent/daemon runs it beside the servers.
//
// The agent holds no package-level state; everything lives in an Agent.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/listers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// Ztunnel is what the agent needs from the ztunnel server
// (*ztunnel.Server implements it).
type Ztunnel interface {
	AddWorkload(ctx context.Context, w ztunnel.Workload, netns *podnetns.Handle) error
	DelWorkload(ctx context.Context, uid string) error
	SubscribeSnapshotAcked() (<-chan struct{}, func())
	// SubscribeStatus is signalled on every change of Status (a ztunnel
	// connected, acked its snapshot, or left).
	SubscribeStatus() (<-chan struct{}, func())
	Status() ztunnel.Status
}

// Rules is what the agent needs from the rule manager (*iptables.Manager
// implements it). The pod netns is a *podnetns.Handle, passed as ns.NetNS.
type Rules interface {
	ApplyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) error
	DeletePod(ctx context.Context, podNS ns.NetNS) error
	VerifyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) (iptables.Drift, error)
	AddProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error
	RemoveProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error
	PruneProbeIPs(ctx context.Context, live map[string][]netip.Addr) (iptables.ProbeChanges, error)
	// RepairHostRules verifies the node's host rules (probe SNAT and its
	// jump) and repairs them, reporting what it repaired.
	RepairHostRules(ctx context.Context) (iptables.Drift, error)
	// DumpPod reads the live rules of a pod's netns, changing nothing.
	DumpPod(ctx context.Context, podNS ns.NetNS) (string, error)
}

// Netns is how the agent reaches pods' network namespaces: it opens the
// one a CNI ADD names, tells the node's own apart, checks that a held one
// is still the pod's (its addresses) and finds running pods' in the host's
// /proc. *podnetns.Finder is the real one (New takes podnetns.New of
// Config.HostProc when Deps.Netns is nil); unit tests of the agent's logic
// hand it a fake, so they need no network namespace of their own.
type Netns interface {
	Open(path string) (*podnetns.Handle, error)
	IsHost(h *podnetns.Handle) bool
	Accept(h *podnetns.Handle, ips []netip.Addr) error
	Current(h *podnetns.Handle, ips []netip.Addr) (ok bool, why string, err error)
	Find(ctx context.Context, targets []podnetns.Target) (map[string]*podnetns.Handle, error)
	FindOne(ctx context.Context, t podnetns.Target) (*podnetns.Handle, error)
}

// Config configures an Agent. DefaultConfig holds the defaults; New takes a
// zero field from there.
type Config struct {
	NodeName string
	Policy   policy.Config
	// DNSCapture is the node's default for pods without the dns-capture
	// annotation.
	DNSCapture bool
	// HostProc is the host's /proc, scanned for running pods' netns.
	HostProc string
	// FailPending makes a CNI ADD fail when the pod's rules are in place but
	// ztunnel did not ack it (the pod is then released again). By default
	// such a pod starts: its traffic is captured and held by the redirect
	// until ztunnel takes the pod over.
	FailPending bool
	// PodLookupTimeout bounds how long a CNI ADD waits for a pod the API does
	// not know yet. CacheWait is the first part of it, during which only
	// the informer is waited on; then direct GETs follow with capped
	// exponential backoff.
	PodLookupTimeout, CacheWait time.Duration
	// RetryBaseDelay..RetryMaxDelay is the per-pod backoff of failed syncs,
	// including pending pods.
	RetryBaseDelay, RetryMaxDelay time.Duration
	// Workers sync pods concurrently (informer events, retries).
	Workers int
	// PodConditionType is the pod condition the agent maintains on the
	// pods it enrolls (in the same write as the annotation).
	PodConditionType string
	// VerifyInterval is the period of the drift pass (jittered); 0 = off.
	VerifyInterval time.Duration
	// IPv6 says the rule manager captures IPv6: when false, a pod with an
	// IPv6 address is refused (its IPv6 traffic would bypass ztunnel).
	IPv6 bool
	// RunDir holds the pod state file (netns path and inode per pod,
	// recorded at CNI ADD; tmpfs, so gone after a reboot like the
	// namespaces). Empty: no state file.
	RunDir string
	// MaxParallelAdds bounds the CNI ADDs enrolling at once; more wait
	// (within their deadline). Each runs iptables-restore in the pod's
	// netns, so this bounds the processes a burst of new pods forks.
	MaxParallelAdds int
	// HandOver, when set, is asked once as Run stops (the workers done,
	// the registry still open) whether another node agent takes the node
	// over: a non-nil SuccessorRules is that agent's rule backend, and every
	// enrolled pod's rules are moved there (handover.go). nil: nothing moves
	// (an upgrade or a restart).
	HandOver func(ctx context.Context) (SuccessorRules, error)
	// HandOverTimeout bounds the handover (DefaultHandOverTimeout when 0).
	HandOverTimeout time.Duration
	// ZtunnelGrace is how long the node may be without a ztunnel that
	// serves it (connected, snapshot acked) before every enabled pod is
	// Unserved: condition False/ZtunnelUnavailable, so its Services stop
	// sending it traffic that nothing proxies (served.go). 0 disables it.
	ZtunnelGrace time.Duration
}

// DefaultZtunnelGrace covers one ztunnel container restart (kubelet
// restarts a crashed container at once the first time; ztunnel reconnects
// and acks its snapshot within a second or two) but not a crash loop
// (kubelet's back-off waits 10 s, then 20 s, …). A rolling upgrade the way
// Istio's ztunnel chart does it (maxSurge 1, maxUnavailable 0) has no gap at
// all. See docs/readiness.md, "When ztunnel is gone".
const DefaultZtunnelGrace = 5 * time.Second

// DefaultConfig returns the defaults (the flags of `ambientd run` show them).
func DefaultConfig() Config {
	return Config{
		Policy:           policy.DefaultConfig(),
		DNSCapture:       true,
		HostProc:         "/proc",
		PodLookupTimeout: 10 * time.Second,
		CacheWait:        500 * time.Millisecond,
		RetryBaseDelay:   200 * time.Millisecond,
		RetryMaxDelay:    30 * time.Second,
		Workers:          4,
		PodConditionType: podmeta.ConditionEnrolled,
		VerifyInterval:   60 * time.Second,
		IPv6:             iptables.DefaultIPv6,
		RunDir:           "/var/run/ambientd",
		MaxParallelAdds:  16,
		ZtunnelGrace:     DefaultZtunnelGrace,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.HostProc == "" {
		c.HostProc = d.HostProc
	}
	if c.PodLookupTimeout <= 0 {
		c.PodLookupTimeout = d.PodLookupTimeout
	}
	if c.CacheWait <= 0 {
		c.CacheWait = d.CacheWait
	}
	if c.RetryBaseDelay <= 0 {
		c.RetryBaseDelay = d.RetryBaseDelay
	}
	if c.RetryMaxDelay <= 0 {
		c.RetryMaxDelay = d.RetryMaxDelay
	}
	if c.Workers <= 0 {
		c.Workers = d.Workers
	}
	if c.PodConditionType == "" {
		c.PodConditionType = d.PodConditionType
	}
	if c.MaxParallelAdds <= 0 {
		c.MaxParallelAdds = d.MaxParallelAdds
	}
	if c.Policy.CapturableRuntimeHandlers == nil {
		c.Policy.CapturableRuntimeHandlers = d.Policy.CapturableRuntimeHandlers
	}
	return c
}

// Agent is the node agent. Create with New, then Run.
type Agent struct {
	cfg     Config
	client  kube.Interface
	log     *slog.Logger
	zt      Ztunnel
	rules   Rules
	reg     *registry.Registry
	finder  Netns
	state   *podnetns.State // nil without a RunDir
	status  *podstatus.Patcher
	metrics *metrics

	recorder record.EventRecorder // pod Events

	podInformer cache.SharedIndexInformer
	nsInformer  cache.SharedIndexInformer
	nsLister    listers.ResourceIndexer[*corev1.Namespace]
	rcLister    listers.ResourceIndexer[*nodev1.RuntimeClass] // runtimeVerdict
	queue       workqueue.TypedRateLimitingInterface[string]  // pod uids
	podSeen     broadcast                                     // fires on every pod event

	// decide applies the enrollment policy to a pod: decidePolicy (a
	// test counts the decisions through it).
	decide func(ctx context.Context, pod *corev1.Pod) (policy.Decision, error)

	locks keyedMutex
	// adds holds a token per CNI ADD enrolling (Config.MaxParallelAdds).
	adds chan struct{}

	// refused holds the uids a ztunnel refused in its snapshot, until
	// their next sync takes them (under the per-pod lock) back to pending.
	refused uidSet
	// moved holds the uids whose phase a running sync moved.
	moved uidSet
	// readds holds the pods a closed ztunnel held, for their sync to Add
	// to the newest one (readd.go).
	readds readdSet
	// invalid remembers the invalid annotation values already reported.
	invalid invalidSeen

	// served follows whether a ztunnel serves the node (served.go).
	served servedState

	lastAck   atomic.Int64 // unix nanos of the last ztunnel snapshot ack
	synced    atomic.Bool  // informer caches synced
	running   atomic.Bool  // rebuild done, workers started
	liveLoops atomic.Int32
	wantLoops int32
}

const uidIndex = "uid"

// Deps are what an Agent works with. The daemon builds them once and
// shares them with the process's other parts; all are required.
type Deps struct {
	Client kube.Interface
	// Informers: the agent watches this node's pods, every namespace and
	// every RuntimeClass through them. It adds its transforms, indexers
	// and handlers in New; the owner starts them afterwards and stops
	// them after Run returned.
	Informers *kube.Informers
	// Recorder records the pods' Events (kube.Events).
	Recorder record.EventRecorder
	Ztunnel  Ztunnel
	Rules    Rules
	// Registry is the pod registry; the agent owns it (Run closes it).
	Registry *registry.Registry
	// Netns reaches pods' network namespaces (nil: podnetns.New of
	// Config.HostProc).
	Netns Netns
	Log   *slog.Logger // nil discards
	// Istio counts the informer events under Istio's
	// nodeagent_reconcile_events_total (nil: not counted).
	Istio *istiometrics.Metrics
}

// New builds an agent from d. The agent is the ztunnel server's snapshot
// source (Snapshot, SnapshotRefused, Readd).
func New(cfg Config, d Deps) (*Agent, error) {
	cfg = cfg.withDefaults()
	if cfg.NodeName == "" {
		return nil, errors.New("agent: node name is required")
	}
	if d.Client == nil || d.Informers == nil || d.Recorder == nil || d.Ztunnel == nil || d.Rules == nil || d.Registry == nil {
		return nil, errors.New("agent: Client, Informers, Recorder, Ztunnel, Rules and Registry are all required")
	}
	log, client, reg := d.Log, d.Client, d.Registry
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Agent{
		cfg:      cfg,
		client:   client,
		log:      log.With("component", "agent"),
		zt:       d.Ztunnel,
		rules:    d.Rules,
		reg:      reg,
		recorder: d.Recorder,
		finder:   d.Netns,
		adds:     make(chan struct{}, cfg.MaxParallelAdds),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.RetryBaseDelay, cfg.RetryMaxDelay),
			workqueue.TypedRateLimitingQueueConfig[string]{}),
	}
	a.decide = a.decidePolicy
	if a.finder == nil {
		a.finder = podnetns.New(cfg.HostProc)
	}
	if cfg.ZtunnelGrace < 0 {
		return nil, fmt.Errorf("agent: ztunnel grace %v: want 0 (off) or more", cfg.ZtunnelGrace)
	}
	if errs := validation.IsQualifiedName(cfg.PodConditionType); len(errs) > 0 {
		return nil, fmt.Errorf("agent: pod condition type %q: %s", cfg.PodConditionType, strings.Join(errs, "; "))
	}
	if cfg.RunDir != "" {
		st, err := podnetns.OpenState(filepath.Join(cfg.RunDir, "pods.json"))
		if err != nil {
			log.Warn("pod state file unusable; restarts fall back to the /proc scan", "error", err)
		}
		a.state = st
	}
	a.metrics = newMetrics(reg, a.queue.Len)
	a.status = podstatus.New(client, log.With("component", "podstatus"), podstatus.Options{
		ConditionType: cfg.PodConditionType,
		OnResult: func(r podstatus.Result, took time.Duration) {
			a.metrics.annotations.WithLabelValues(string(r)).Inc()
			a.metrics.steps.WithLabelValues("status_write").Observe(took.Seconds())
		},
		OnWritten: a.metrics.meshReady,
	})

	// Pods of this node only; namespaces: all (their labels enroll pods).
	a.podInformer = d.Informers.Pods
	// The cache keeps only what the agent reads of a pod (podmeta.Trim):
	// the rest is most of its heap at hundreds of pods (docs/scale.md).
	trim := podmeta.Trim(corev1.PodConditionType(cfg.PodConditionType), corev1.PodReadyToStartContainers)
	if err := a.podInformer.SetTransform(trim); err != nil {
		return nil, fmt.Errorf("agent: pod informer transform: %w", err)
	}
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
	a.nsInformer = d.Informers.Namespaces
	if err := a.nsInformer.SetTransform(trim); err != nil {
		return nil, fmt.Errorf("agent: namespace informer transform: %w", err)
	}
	a.nsLister = listers.New[*corev1.Namespace](a.nsInformer.GetIndexer(), corev1.Resource("namespace"))
	// RuntimeClasses: the handler a pod runs under decides whether the
	// rules can capture it. Not waited for at start: a lookup the cache
	// cannot answer is a direct GET.
	if err := d.Informers.RuntimeClasses.SetTransform(trim); err != nil {
		return nil, fmt.Errorf("agent: RuntimeClass informer transform: %w", err)
	}
	a.rcLister = listers.New[*nodev1.RuntimeClass](d.Informers.RuntimeClasses.GetIndexer(), nodev1.Resource("runtimeclass"))

	// Event handlers only enqueue keys; all decisions happen in sync.
	// Every event is counted under Istio's name, as Istio's agent counts
	// each pod and namespace event it reconciles.
	im := d.Istio
	if _, err := a.podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { im.ReconcileEvent(istiometrics.EventAdd); a.enqueuePod(obj) },
		UpdateFunc: func(_, obj any) {
			im.ReconcileEvent(istiometrics.EventUpdate)
			a.enqueuePod(obj)
		},
		DeleteFunc: func(obj any) { im.ReconcileEvent(istiometrics.EventDelete); a.enqueuePod(obj) },
	}); err != nil {
		return nil, fmt.Errorf("agent: pod event handler: %w", err)
	}
	if _, err := a.nsInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { im.ReconcileEvent(istiometrics.EventAdd); a.enqueueNamespace(obj) },
		UpdateFunc: func(old, obj any) {
			im.ReconcileEvent(istiometrics.EventUpdate)
			o, n := old.(*corev1.Namespace), obj.(*corev1.Namespace)
			if o.Labels[podmeta.LabelDataplaneMode] != n.Labels[podmeta.LabelDataplaneMode] {
				a.enqueueNamespace(obj)
			}
		},
		DeleteFunc: func(any) { im.ReconcileEvent(istiometrics.EventDelete) },
	}); err != nil {
		return nil, fmt.Errorf("agent: namespace event handler: %w", err)
	}
	return a, nil
}

func (a *Agent) enqueuePod(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	if p, ok := obj.(*corev1.Pod); ok {
		a.queue.Add(string(p.UID))
		a.podSeen.fire()
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

// Run waits for the informer caches (the owner started the informers),
// rebuilds the registry from the API and /proc (so a restarted agent's first
// ztunnel snapshot holds every live pod), then calls ready — the daemon
// starts the ztunnel and CNI servers only then — and runs the workers until
// ctx ends. It returns nil when ctx ends. The registry is closed when Run
// returns.
func (a *Agent) Run(ctx context.Context, ready func()) error {
	if a.state != nil {
		defer a.state.Close() // last: the journal's descriptor
	}
	defer a.reg.Close()
	defer a.handOver() // after the workers, before the registry closes
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	a.log.Info("waiting for informer caches", "node", a.cfg.NodeName)
	if !cache.WaitForCacheSync(ctx.Done(), a.podInformer.HasSynced, a.nsInformer.HasSynced) {
		return nil // ctx ended before the caches synced: a clean stop
	}
	a.synced.Store(true)

	a.rebuild(ctx)

	acked, unsubscribe := a.zt.SubscribeSnapshotAcked()
	defer unsubscribe()
	status, unsubscribeStatus := a.zt.SubscribeStatus()
	defer unsubscribeStatus()
	a.wantLoops = int32(a.cfg.Workers) + 2
	// Loops count as live from before they start, so /healthz never sees a
	// loop "missing" that simply has not been scheduled yet; each one takes
	// itself off the count when it returns.
	a.liveLoops.Add(a.wantLoops)
	wg.Go(func() { a.retryOnSnapshotAck(ctx, acked) })
	wg.Go(func() { a.followZtunnel(ctx, status) })
	for range a.cfg.Workers {
		wg.Go(func() { a.worker(ctx) })
	}
	context.AfterFunc(ctx, a.queue.ShutDown)
	a.running.Store(true)
	a.log.Info("agent running", "node", a.cfg.NodeName, "pods", a.reg.Len())
	ready()
	<-ctx.Done()
	return nil
}

// RunStatusWriter writes queued pod status until ctx ends (the daemon runs
// it beside the agent, and stops it after the agent).
func (a *Agent) RunStatusWriter(ctx context.Context) error {
	a.status.Run(ctx, 2)
	return nil
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
			a.lastAck.Store(time.Now().UnixNano())
			pending := append(a.reg.UIDs(registry.Pending), a.reg.UIDs(registry.Unverified)...)
			pending = append(pending, a.reg.UIDs(registry.Uncaptured)...)
			pending = append(pending, a.reg.UIDs(registry.Unserved)...)
			if len(pending) > 0 {
				a.log.Info("ztunnel snapshot acked, retrying pending pods", "pending", len(pending))
			}
			for _, uid := range pending {
				a.metrics.retries.WithLabelValues("snapshot_ack").Inc()
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
		_, err := a.sync(ctx, uid, nil)
		switch {
		case err == nil:
			a.queue.Forget(uid)
		case ctx.Err() != nil:
			a.queue.Forget(uid)
		default:
			a.metrics.retry(err)
			a.queue.AddRateLimited(uid)
		}
		a.queue.Done(uid)
	}
}
