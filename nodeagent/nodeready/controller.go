package nodeready

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/client-go/listers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/nodeagent/kube"
)

// Deps are the controller's collaborators.
type Deps struct {
	Client kube.Interface // required
	Inputs Inputs         // required, every func
	// Node is the informer of this one Node (kube.Informers.Node): changes
	// made by others (a taint put back, the condition edited) are seen
	// without polling. Required; its owner starts it.
	Node cache.SharedIndexInformer
	// Recorder records the Node's Events (kube.Events). Required.
	Recorder record.EventRecorder
	Log      *slog.Logger     // nil discards
	Now      func() time.Time // nil: time.Now
	// Started is when the agent's process started, the start of
	// ambientd_node_mesh_ready_seconds (zero: when New ran).
	Started time.Time
}

// Status is the controller's view, for /readyz and `ambientd status`.
type Status struct {
	// Condition is Unknown until the first evaluation.
	Condition corev1.ConditionStatus
	Reason    string
	Message   string
	// Written is true once the node carries the current condition.
	Written bool
	// TaintPresent: the taint key is on the node as last seen.
	TaintPresent bool
	// LastError is the last reconcile error, empty after a success.
	LastError string
}

// Err is nil when the node condition is True and written to the node,
// else an error naming the reason: a ready-made /readyz check.
func (s Status) Err() error {
	switch {
	case s.Condition == corev1.ConditionUnknown:
		return errors.New("node readiness not evaluated yet")
	case s.Condition != corev1.ConditionTrue:
		return fmt.Errorf("node not ready for the mesh: %s: %s", s.Reason, s.Message)
	case !s.Written:
		return fmt.Errorf("node condition not written yet: %s", s.LastError)
	}
	return nil
}

// Controller maintains the condition and taint of one node.
type Controller struct {
	cfg    Config
	client kube.Interface
	in     Inputs
	log    *slog.Logger
	now    func() time.Time
	rec    record.EventRecorder
	inf    cache.SharedIndexInformer

	trigger chan struct{}
	// wroteTransition is when this process last wrote a status change of
	// the condition (only Run's goroutine uses it).
	wroteTransition time.Time
	// announcedFalse: this process recorded the Event of the condition's
	// turn to False (Run's goroutine only).
	announcedFalse bool
	// ours is the Node as our last write returned it: newer than the
	// watch cache until the cache catches up (Run's goroutine only).
	ours *corev1.Node
	// settling is the False status and reason waiting out Settle, since
	// settlingSince ("" when none; Run's goroutine only).
	settling      string
	settlingSince time.Time
	// started is the process's start; meshReady observes, once, from it
	// to the first time the node carries the condition True (wasTrue,
	// only Run's goroutine uses it).
	started   time.Time
	meshReady prometheus.Histogram
	wasTrue   bool

	mu     sync.Mutex
	status Status
}

// New builds a controller for cfg.NodeName; that name cannot change later.
func New(cfg Config, deps Deps) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("nodeready: %w", err)
	}
	if deps.Client == nil {
		return nil, errors.New("nodeready: a Kubernetes client is required")
	}
	if !deps.Inputs.complete() {
		return nil, errors.New("nodeready: inputs PluginInstalled, AgentStarted, Ztunnel and CNIServing are all required")
	}
	if deps.Node == nil || deps.Recorder == nil {
		return nil, errors.New("nodeready: the Node informer and an Event recorder are required")
	}
	c := &Controller{
		cfg:     cfg.withDefaults(),
		client:  deps.Client,
		in:      deps.Inputs,
		log:     deps.Log,
		now:     deps.Now,
		rec:     deps.Recorder,
		inf:     deps.Node,
		trigger: make(chan struct{}, 1),
		status:  Status{Condition: corev1.ConditionUnknown},
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	c.log = c.log.With("component", "nodeready", "node", c.cfg.NodeName)
	if c.now == nil {
		c.now = time.Now
	}
	c.started = deps.Started
	if c.started.IsZero() {
		c.started = c.now()
	}
	c.meshReady = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ambientd_node_mesh_ready_seconds",
		Help:    "From the agent process's start to the node carrying its condition True for the first time (observed once per process).",
		Buckets: prometheus.ExponentialBuckets(0.25, 2, 12),
	})
	return c, nil
}

// Metrics are the controller's collectors (not registered anywhere; the
// daemon registers them): ambientd_node_mesh_ready_seconds.
func (c *Controller) Metrics() prometheus.Collector { return c.meshReady }

// Notify asks for a re-evaluation soon; call it whenever an input may have
// changed. It never blocks.
func (c *Controller) Notify() {
	select {
	case c.trigger <- struct{}{}:
	default:
	}
}

// Status returns the current view.
func (c *Controller) Status() Status {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.status
}

// Run watches the node and reconciles on Notify, on node changes, on every
// resync and when a re-taint grace period ends, until ctx ends. It returns
// nil then and writes nothing on the way out: stopping the agent (an
// upgrade) never changes the condition or the taint. Call it once.
func (c *Controller) Run(ctx context.Context) error {
	inf := c.inf
	lister := listers.New[*corev1.Node](inf.GetIndexer(), corev1.Resource("node"))
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { c.Notify() },
		UpdateFunc: func(_, _ any) { c.Notify() },
	})
	if err != nil {
		return fmt.Errorf("nodeready: node event handler: %w", err)
	}
	defer inf.RemoveEventHandler(reg)
	if !cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
		return nil // ctx ended
	}

	resync := time.NewTicker(c.cfg.ResyncPeriod)
	defer resync.Stop()
	// wake fires for a retry after an error or when a re-taint grace ends.
	wake := time.NewTimer(0)
	defer wake.Stop()
	<-wake.C
	backoff := 200 * time.Millisecond
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c.trigger:
		case <-resync.C:
		case <-wake.C:
		}
		if ctx.Err() != nil {
			return nil // a Notify raced with shutdown: write nothing
		}
		after, err := c.reconcile(ctx, lister)
		c.setError(err)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			c.log.Warn("node readiness reconcile failed", "error", err, "retry_in", backoff)
			after = backoff
			backoff = min(backoff*2, c.cfg.ResyncPeriod)
		} else {
			backoff = 200 * time.Millisecond
		}
		if after > 0 {
			wake.Reset(after)
		}
	}
}

func (c *Controller) setError(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.status.LastError = ""
	if err != nil {
		c.status.LastError = err.Error()
	}
}

// nodeLister reads nodes from the watch cache (nil: no cache).
type nodeLister interface {
	Get(name string) (*corev1.Node, error)
}

// node returns this node from the watch cache, or from the apiserver when
// the cache does not have it (yet).
func (c *Controller) node(ctx context.Context, lister nodeLister) (*corev1.Node, error) {
	if lister != nil {
		if n, err := lister.Get(c.cfg.NodeName); err == nil {
			return n, nil
		}
	}
	n, err := c.client.CoreV1().Nodes().Get(ctx, c.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get node %s: %w", c.cfg.NodeName, err)
	}
	return n, nil
}

// reconcile writes the condition if it changed or its heartbeat is due,
// then the taint if it must change. It returns when to look again for a
// pending re-taint or the next heartbeat (0: no need).
func (c *Controller) reconcile(ctx context.Context, lister nodeLister) (time.Duration, error) {
	r := Compute(c.in)
	c.mu.Lock()
	c.status.Condition, c.status.Reason, c.status.Message = r.Status(), r.Reason, r.Message
	c.mu.Unlock()

	n, err := c.node(ctx, lister)
	if err != nil {
		return 0, err
	}
	// The watch cache may lag our own last write: decide on the newer of
	// the two, so lastTransitionTime and Events stay exact without a GET.
	if c.ours != nil && newer(c.ours, n) {
		n = c.ours
	}
	ctype := corev1.NodeConditionType(c.cfg.ConditionType)
	cur := findCondition(n, ctype)
	now := c.now()
	want, changed := desiredCondition(cur, ctype, r, now, c.cfg.HeartbeatPeriod)
	settleIn := time.Duration(0)
	if changed {
		settleIn = c.settle(cur, want, now)
		changed = settleIn == 0
	} else {
		c.settling = ""
	}
	c.mu.Lock()
	c.status.Written = !changed
	c.mu.Unlock()
	if changed {
		if n, err = c.writeCondition(ctx, want); err != nil {
			return 0, err
		}
		c.ours = n
		transition := cur == nil || cur.Status != want.Status
		if transition {
			c.wroteTransition = want.LastTransitionTime.Time
			c.announce(n, cur, r)
		}
		if transition || cur.Reason != want.Reason || cur.Message != want.Message {
			c.log.Info("node condition written", "condition", want.Type, "status", want.Status, "reason", want.Reason, "message", want.Message)
		} else {
			c.log.Debug("node condition heartbeat", "condition", want.Type, "status", want.Status)
		}
		c.mu.Lock()
		c.status.Written = true
		c.mu.Unlock()
	}
	// The node carries want now (written, or already there).
	if want.Status == corev1.ConditionTrue && !c.wasTrue {
		c.wasTrue = true
		c.meshReady.Observe(max(c.now().Sub(c.started), 0).Seconds())
	}
	after, err := c.reconcileTaint(ctx, n, r.Ready)
	if err != nil {
		return 0, err
	}
	// Look again when the next heartbeat is due (the resync may be slower).
	if hb := heartbeatIn(findCondition(n, ctype), c.cfg.HeartbeatPeriod, c.now()); hb > 0 && (after == 0 || hb < after) {
		after = hb
	}
	if settleIn > 0 && (after == 0 || settleIn < after) {
		after = settleIn
	}
	return after, nil
}

// settle returns how long the write of want must still wait (0: write
// now). A False condition, or a new reason while False, is written once it
// has held for Settle; True, and a heartbeat or message of an unchanged
// False, at once.
func (c *Controller) settle(cur *corev1.NodeCondition, want corev1.NodeCondition, now time.Time) time.Duration {
	if c.cfg.Settle <= 0 || want.Status == corev1.ConditionTrue || (cur != nil && cur.Status == want.Status && cur.Reason == want.Reason) {
		c.settling = ""
		return 0
	}
	key := string(want.Status) + "/" + want.Reason
	if c.settling != key {
		c.settling, c.settlingSince = key, now
	}
	if wait := c.cfg.Settle - now.Sub(c.settlingSince); wait > 0 {
		return wait
	}
	c.settling = ""
	return 0
}

// newer reports whether a is a later version of the Node than b, by their
// resourceVersions (false when they do not compare).
func newer(a, b *corev1.Node) bool {
	cmp, err := resourceversion.CompareResourceVersion(a.ResourceVersion, b.ResourceVersion)
	return err == nil && cmp > 0
}

func (c *Controller) writeCondition(ctx context.Context, cond corev1.NodeCondition) (*corev1.Node, error) {
	p, err := conditionPatch(cond)
	if err != nil {
		return nil, err
	}
	n, err := c.client.CoreV1().Nodes().Patch(ctx, c.cfg.NodeName, types.StrategicMergePatchType, p, metav1.PatchOptions{}, "status")
	if err != nil {
		return nil, fmt.Errorf("patch node %s condition %s: %w", c.cfg.NodeName, cond.Type, err)
	}
	return n, nil
}

// announce records the Event of a transition of the condition from cur
// to r, unless Config.AnnouncedElsewhere has it: a False for one of those
// reasons, and the True that ends it when this controller did not
// announce that False itself.
func (c *Controller) announce(n *corev1.Node, cur *corev1.NodeCondition, r Readiness) {
	elsewhere := func(reason string) bool { return slices.Contains(c.cfg.AnnouncedElsewhere, reason) }
	switch {
	case !r.Ready && elsewhere(r.Reason):
		c.announcedFalse = false
		return
	case r.Ready && cur != nil && cur.Status == corev1.ConditionFalse && elsewhere(cur.Reason) && !c.announcedFalse:
		return
	}
	c.announcedFalse = !r.Ready
	c.event(n, r)
}

func (c *Controller) event(n *corev1.Node, r Readiness) {
	if r.Ready {
		c.rec.Eventf(nodeRef(n), corev1.EventTypeNormal, EventAmbientReady, "%s is True: %s", c.cfg.ConditionType, r.Message)
		return
	}
	c.rec.Eventf(nodeRef(n), corev1.EventTypeWarning, EventAmbientNotReady, "%s is False (%s): %s", c.cfg.ConditionType, r.Reason, r.Message)
}

// nodeRef is the Events' subject. A reference, not the Node, so the
// recorder needs no lookup and the Event names the node's UID.
func nodeRef(n *corev1.Node) *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}
}
