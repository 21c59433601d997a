// Package podstatus writes what a pod shows about its enrollment: the
// ambient.istio.io/redirection annotation and the pod condition
// ambient.istio.io/enrolled (a Status field each). Both go in ONE strategic
// merge patch of the pods/status subresource (what the agent's RBAC allows;
// the condition is merged by its type, so kubelet's conditions are
// untouched), with the pod's uid as a precondition. Writes are queued and
// retried with capped backoff until they land, so a slow or unreachable API
// server never blocks enrollment. Only the newest wanted value
// of a pod is written; a pod that is gone (or replaced by a new pod of the same
// name) is dropped.
package podstatus

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/podmeta"
)

// Status is what one pod should show. The agent derives it from the pod's
// phase in one place; adding a field means adding it here, to that
// derivation and to the patch body below.
type Status struct {
	// Redirection is the ambient.istio.io/redirection value; "" removes it.
	Redirection string
	// Condition is the pod condition (of Options.ConditionType); a zero
	// Condition leaves the pod's condition as it is.
	Condition Condition
	// FirstTrue marks a write that turns the pod's condition True for the
	// first time (the pod was never carried before); it is not written,
	// only handed to Options.OnWritten once the write landed. Equal
	// ignores it.
	FirstTrue bool
}

// Condition is the value of the agent's pod condition.
type Condition struct {
	Status  corev1.ConditionStatus // "" = no say
	Reason  string
	Message string
	// Since is the lastTransitionTime to write: when Status last changed.
	// Equal ignores it.
	Since time.Time
}

// Equal reports whether s and o show the same, ignoring Condition.Since
// (a time read back from the API has second precision).
func (s Status) Equal(o Status) bool {
	a, b := s.Condition, o.Condition
	return s.Redirection == o.Redirection && a.Status == b.Status && a.Reason == b.Reason && a.Message == b.Message
}

// Key names one pod: a pod recreated under the same name (a StatefulSet pod)
// is another pod, so a write for the old one never replaces the new one's.
type Key struct{ Namespace, Name, UID string }

func (k Key) String() string { return k.Namespace + "/" + k.Name + " (uid " + k.UID + ")" }

type want struct {
	uid    string
	status Status
	gen    uint64
}

// Result is reported to the optional OnResult hook after every attempt.
type Result string

const (
	ResultOK      Result = "ok"
	ResultRetry   Result = "retry"   // failed, will retry
	ResultDropped Result = "dropped" // pod gone or replaced; not retried
)

// Options tune the patcher. Zero values take the defaults.
type Options struct {
	BaseDelay, MaxDelay time.Duration // retry backoff, default 100ms .. 5s
	Timeout             time.Duration // per request, default 10s
	// ConditionType is the pod condition Status.Condition is written as;
	// empty writes no condition at all.
	ConditionType string
	// OnResult, when set, is called after each attempt with how long the
	// write took (metrics hook).
	OnResult func(r Result, took time.Duration)
	// OnWritten, when set, is called after each write that landed, with
	// the status written and the pod as the API server returned it.
	OnWritten func(st Status, pod *corev1.Pod)
}

// Patcher queues pod status writes (the annotation and the condition, one
// patch). Create with New, then Run.
type Patcher struct {
	client kube.Interface
	log    *slog.Logger
	opts   Options
	queue  workqueue.TypedRateLimitingInterface[Key]

	mu     sync.Mutex
	wanted map[Key]want
	gen    uint64
	// landed are the writes that landed in the last landedFor, by pod
	// uid, with the pod's resourceVersion after each (LandedAfter).
	landed map[string]landedWrite
	pruned time.Time
	// drained, when not nil, is closed once wanted is empty (Flush).
	drained chan struct{}
}

// New returns a Patcher using client.
func New(client kube.Interface, log *slog.Logger, opts Options) *Patcher {
	if opts.BaseDelay <= 0 {
		opts.BaseDelay = 100 * time.Millisecond
	}
	if opts.MaxDelay <= 0 {
		opts.MaxDelay = 5 * time.Second
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	return &Patcher{
		client: client,
		log:    log,
		opts:   opts,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[Key](opts.BaseDelay, opts.MaxDelay),
			workqueue.TypedRateLimitingQueueConfig[Key]{}),
		wanted: make(map[Key]want),
		landed: make(map[string]landedWrite),
	}
}

// landedFor is how long a landed write is remembered: far longer than a
// watch cache lags behind its own writes, short enough that the memory of
// a node's churn stays small.
const landedFor = time.Minute

type landedWrite struct {
	status Status
	rv     string
	at     time.Time
}

// LandedAfter reports whether a write of st to pod uid landed after the
// pod's version rv: a pod read at rv (from a watch cache that lags the
// agent's own write) does not show st yet, and writing st again would
// change nothing. Versions that do not compare (another store) report
// false, so the write is made.
func (p *Patcher) LandedAfter(uid, rv string, st Status) bool {
	p.mu.Lock()
	l, ok := p.landed[uid]
	p.mu.Unlock()
	if !ok || !l.status.Equal(st) || rv == "" {
		return false
	}
	c, err := resourceversion.CompareResourceVersion(l.rv, rv)
	return err == nil && c > 0
}

// remember records a landed write (under mu), pruning what is older than
// landedFor at most once per landedFor.
func (p *Patcher) remember(uid string, w landedWrite) {
	p.landed[uid] = w
	if w.at.Sub(p.pruned) < landedFor {
		return
	}
	for u, l := range p.landed {
		if w.at.Sub(l.at) > landedFor {
			delete(p.landed, u)
		}
	}
	p.pruned = w.at
}

// Set asks for pod namespace/name (which must have uid) to show st. It never
// blocks. A write not landed yet that st replaces with the same status
// hands its FirstTrue on: the first True stays the first once it lands.
func (p *Patcher) Set(namespace, name, uid string, st Status) {
	k := Key{namespace, name, uid}
	p.mu.Lock()
	if prev, ok := p.wanted[k]; ok && prev.status.FirstTrue && prev.status.Equal(st) {
		st.FirstTrue = true
	}
	p.gen++
	p.wanted[k] = want{uid: uid, status: st, gen: p.gen}
	p.mu.Unlock()
	p.queue.Add(k)
}

// Pending returns the number of writes not landed yet.
func (p *Patcher) Pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.wanted)
}

// queued returns the status queued for a pod and whether a write is queued.
func (p *Patcher) queued(namespace, name, uid string) (Status, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w, ok := p.wanted[Key{namespace, name, uid}]
	return w.status, ok
}

// Run writes the queued pod statuses with the given number of workers until ctx
// ends.
func (p *Patcher) Run(ctx context.Context, workers int) {
	if workers < 1 {
		workers = 1
	}
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for p.next(ctx) {
			}
		})
	}
	<-ctx.Done()
	p.queue.ShutDown()
	wg.Wait()
}

func (p *Patcher) next(ctx context.Context) bool {
	k, quit := p.queue.Get()
	if quit {
		return false
	}
	defer p.queue.Done(k)
	p.mu.Lock()
	w, ok := p.wanted[k]
	p.mu.Unlock()
	if !ok {
		p.queue.Forget(k)
		return true
	}
	start := time.Now()
	pod, err := p.patch(ctx, k, w)
	took := time.Since(start)
	res := ResultOK
	switch {
	case err == nil:
		if p.opts.OnWritten != nil {
			p.opts.OnWritten(w.status, pod)
		}
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err) || apierrors.IsInvalid(err):
		// Gone, or a different pod now has this name (the uid precondition
		// failed): the write is moot.
		res = ResultDropped
		p.log.Info("pod status write dropped", "namespace", k.Namespace, "pod", k.Name, "uid", w.uid, "status", w.status, "error", err)
	default:
		res = ResultRetry
	}
	if p.opts.OnResult != nil {
		p.opts.OnResult(res, took)
	}
	if res == ResultRetry {
		if ctx.Err() == nil {
			p.log.Warn("pod status write failed, retrying", "namespace", k.Namespace, "pod", k.Name, "uid", w.uid, "status", w.status, "error", err)
		}
		p.queue.AddRateLimited(k)
		return true
	}
	p.queue.Forget(k)
	p.mu.Lock()
	if res == ResultOK {
		p.remember(w.uid, landedWrite{status: w.status, rv: pod.ResourceVersion, at: time.Now()})
	}
	if cur, ok := p.wanted[k]; ok && cur.gen == w.gen {
		delete(p.wanted, k)
	} else if ok && res == ResultOK && w.status.FirstTrue {
		// A later write of the same status inherited the mark (Set)
		// while this one was in flight: the first True has landed.
		cur.status.FirstTrue = false
		p.wanted[k] = cur
	}
	if len(p.wanted) == 0 && p.drained != nil {
		close(p.drained)
		p.drained = nil
	}
	p.mu.Unlock()
	return true
}

// Flush waits until every write queued so far (and since) has landed or
// been dropped, or ctx ends (its error). Run must be running: an agent
// that stops writes its last status through it (a handover).
func (p *Patcher) Flush(ctx context.Context) error {
	for {
		p.mu.Lock()
		if len(p.wanted) == 0 {
			p.mu.Unlock()
			return nil
		}
		if p.drained == nil {
			p.drained = make(chan struct{})
		}
		ch := p.drained
		p.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("podstatus: %d writes not landed: %w", p.Pending(), ctx.Err())
		}
	}
}

// patchBody is the one write of a pod's status: the annotation and the
// condition together, so nobody ever sees one without the other.
// metadata.uid is a precondition: if the pod was recreated under the same
// name, the API server rejects the write. status.conditions is merged by
// type (the list's patch merge key), so other conditions stay as they are.
func patchBody(uid, conditionType string, st Status) ([]byte, error) {
	var val any
	if st.Redirection != "" {
		val = st.Redirection
	}
	body := map[string]any{
		"metadata": map[string]any{
			"uid":         uid,
			"annotations": map[string]any{podmeta.AnnotationRedirection: val},
		},
	}
	if c := st.Condition; conditionType != "" && c.Status != "" {
		since := c.Since
		if since.IsZero() {
			since = time.Now()
		}
		body["status"] = map[string]any{
			"conditions": []any{map[string]any{
				"type":               conditionType,
				"status":             c.Status,
				"reason":             c.Reason,
				"message":            c.Message,
				"lastTransitionTime": metav1.NewTime(since),
			}},
		}
	}
	b, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("podstatus: encode patch: %w", err)
	}
	return b, nil
}

// patch sends the strategic merge patch of patchBody; it returns the pod
// as the API server returned it.
func (p *Patcher) patch(ctx context.Context, k Key, w want) (*corev1.Pod, error) {
	body, err := patchBody(w.uid, p.opts.ConditionType, w.status)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, p.opts.Timeout)
	defer cancel()
	pod, err := p.client.CoreV1().Pods(k.Namespace).Patch(ctx, k.Name, types.StrategicMergePatchType, body, metav1.PatchOptions{}, "status")
	if err != nil {
		return nil, fmt.Errorf("podstatus: patch %s %+v: %w", k, w.status, err)
	}
	return pod, nil
}
