package sidecar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// Rules is what sidecar mode needs of the rule manager (*iptables.Manager
// implements it).
type Rules interface {
	ApplySidecar(ctx context.Context, podNS ns.NetNS, o iptables.SidecarOptions, old *iptables.SidecarOptions) error
	VerifySidecar(ctx context.Context, podNS ns.NetNS, o iptables.SidecarOptions) (iptables.Drift, error)
	DeleteSidecar(ctx context.Context, podNS ns.NetNS, o *iptables.SidecarOptions) error
}

// Reasons of the Events sidecar mode records on pods.
const (
	// EventCaptureFailed (Warning): the pod's sidecar rules could not be
	// programmed at CNI ADD (an invalid annotation, the rules); the ADD
	// fails and the runtime retries the sandbox.
	EventCaptureFailed = "SidecarCaptureFailed"
	// EventRulesRepaired (Warning): the drift pass or a restart found the
	// pod's sidecar rules changed and put them back (the ambient pods'
	// reason).
	EventRulesRepaired = "RulesRepaired"
)

// Config configures a Tracker.
type Config struct {
	NodeName string
	// Policy decides which pods are sidecar pods (the agent's policy).
	Policy policy.Config
	// HostProc is the node's /proc, scanned for running pods' netns after
	// a restart.
	HostProc string
	// VerifyInterval is the period of the drift pass (jittered ±10%); 0:
	// off.
	VerifyInterval time.Duration
}

// entry is a pod whose sidecar rules this agent programmed: its sandbox's
// namespace (path and inode; no descriptor is held, so the namespace, and
// the rules with it, go away with the sandbox) and the options.
type entry struct {
	namespace, name string
	netnsPath       string
	inode           uint64
	opts            iptables.SidecarOptions
}

// Tracker is sidecar mode's state: the sidecar pods of this node whose
// rules the agent programmed, verified and repaired like the ambient pods'.
type Tracker struct {
	cfg      Config
	rules    Rules
	log      *slog.Logger
	recorder record.EventRecorder
	pods     cache.SharedIndexInformer
	finder   *podnetns.Finder
	metrics  *metrics

	mu      sync.Mutex
	tracked map[string]entry // pod uid -> entry
}

// New builds a Tracker over the agent's pod informer (this node's pods).
// recorder records pod Events (may be nil); reg gets the metrics.
func New(cfg Config, rules Rules, pods cache.SharedIndexInformer, recorder record.EventRecorder, reg prometheus.Registerer, log *slog.Logger) (*Tracker, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.HostProc == "" {
		cfg.HostProc = "/proc"
	}
	t := &Tracker{
		cfg: cfg, rules: rules, log: log.With("component", "sidecar"), recorder: recorder, pods: pods,
		finder: podnetns.New(cfg.HostProc), tracked: map[string]entry{},
	}
	m, err := newMetrics(reg, t.Len)
	if err != nil {
		return nil, err
	}
	t.metrics = m
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if p, ok := obj.(*corev1.Pod); ok {
				t.Forget(string(p.UID))
			}
		},
	}); err != nil {
		return nil, fmt.Errorf("sidecar: pod event handler: %w", err)
	}
	return t, nil
}

// Len is how many sidecar pods are tracked.
func (t *Tracker) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.tracked)
}

// Tracked reports whether pod uid's rules are tracked, and the options.
func (t *Tracker) Tracked(uid string) (iptables.SidecarOptions, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.tracked[uid]
	return e.opts, ok
}

// Forget drops pod uid (its sandbox or object is gone; the rules went with
// the namespace).
func (t *Tracker) Forget(uid string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.tracked, uid)
}

func (t *Tracker) event(namespace, name, uid, reason, msg string) {
	if t.recorder == nil {
		return
	}
	t.recorder.Event(&corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: namespace, Name: name, UID: types.UID(uid)},
		corev1.EventTypeWarning, reason, msg)
}

// Capture is the CNI ADD of a sidecar pod (the policy decided it): its
// capture options are read from the pod, its rules programmed in the
// runtime's namespace (netns, opened by the ADD, which keeps and closes it)
// and the pod tracked. An invalid annotation or a rule
// failure is an error (the ADD fails, as with Istio, and the runtime
// retries the sandbox): the app must never start with its traffic
// unredirected. ips are the pod's addresses from the chain's prevResult.
func (t *Tracker) Capture(ctx context.Context, pod *corev1.Pod, netns *podnetns.Handle, ips []netip.Addr) error {
	start := time.Now()
	err := t.capture(ctx, pod, netns, ips)
	t.metrics.adds.WithLabelValues(resultLabel(err)).Inc()
	t.metrics.addTime.Observe(time.Since(start).Seconds())
	if err != nil {
		t.event(pod.Namespace, pod.Name, string(pod.UID), EventCaptureFailed, "Redirecting the pod's traffic to its istio-proxy failed: "+err.Error())
	}
	return err
}

func resultLabel(err error) string {
	switch {
	case err == nil:
		return "captured"
	case errors.Is(err, ErrInvalidAnnotation):
		return "invalid_annotation"
	}
	return "error"
}

func (t *Tracker) capture(ctx context.Context, pod *corev1.Pod, h *podnetns.Handle, ips []netip.Addr) error {
	if len(ips) == 0 {
		ips = podmeta.IPs(pod)
	}
	p, err := Parse(pod, ips)
	if err != nil {
		return fmt.Errorf("sidecar pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	log := t.log.With("namespace", pod.Namespace, "pod", pod.Name, "uid", string(pod.UID))
	for _, w := range p.Warnings {
		log.Warn("pod setting ignored", "reason", w)
	}
	var old *iptables.SidecarOptions
	if o, ok := t.Tracked(string(pod.UID)); ok {
		old = &o
	}
	if err := t.rules.ApplySidecar(ctx, h, p.Options, old); err != nil {
		return fmt.Errorf("sidecar pod %s/%s: program rules: %w", pod.Namespace, pod.Name, err)
	}
	t.mu.Lock()
	t.tracked[string(pod.UID)] = entry{namespace: pod.Namespace, name: pod.Name, netnsPath: h.Path(), inode: h.Inode(), opts: p.Options}
	t.mu.Unlock()
	log.Info("sidecar pod captured", "netns", h.Path(), "mode", p.Options.Mode, "ipv6", p.Options.IPv6, "dns", p.Options.DNS)
	return nil
}

// Run rebuilds the tracked pods once the pod cache has synced (restart
// verification), then runs the drift pass every VerifyInterval until ctx
// ends.
func (t *Tracker) Run(ctx context.Context) error {
	if !cache.WaitForCacheSync(ctx.Done(), t.pods.HasSynced) {
		return nil
	}
	t.Rebuild(ctx)
	if t.cfg.VerifyInterval <= 0 {
		<-ctx.Done()
		return nil
	}
	for {
		d := time.Duration(float64(t.cfg.VerifyInterval) * (0.9 + 0.2*rand.Float64()))
		timer := time.NewTimer(d)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-timer.C:
		}
		t.VerifyPass(ctx)
	}
}

// Rebuild is the restart step: every running sidecar pod of this node (the
// policy's decision, from the pod cache) that is not tracked has its
// namespace found (one /proc pass for all) and its rules read back and
// repaired only where they differ; it is tracked from then on. A pod whose
// namespace is not found is left to its next CNI ADD.
func (t *Tracker) Rebuild(ctx context.Context) {
	var targets []podnetns.Target
	pods := map[string]*corev1.Pod{}
	for _, obj := range t.pods.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Spec.NodeName != t.cfg.NodeName && t.cfg.NodeName != "" || p.Status.Phase != corev1.PodRunning {
			continue
		}
		if _, ok := t.Tracked(string(p.UID)); ok {
			continue
		}
		if d := t.cfg.Policy.Decide(p, nil); !d.Sidecar || len(podmeta.IPs(p)) == 0 {
			continue
		}
		pods[string(p.UID)] = p
		targets = append(targets, podnetns.Target{UID: string(p.UID), IPs: podmeta.IPs(p)})
	}
	if len(targets) == 0 {
		return
	}
	start := time.Now()
	found, err := t.finder.Find(ctx, targets)
	if err != nil {
		t.log.Warn("scanning host proc for sidecar pods' netns", "error", err)
	}
	verified := 0
	for uid, h := range found {
		p := pods[uid]
		parsed, err := Parse(p, podmeta.IPs(p))
		if err != nil {
			h.Close()
			t.log.Warn("restored sidecar pod has invalid annotations; not verified", "namespace", p.Namespace, "pod", p.Name, "error", err)
			continue
		}
		e := entry{namespace: p.Namespace, name: p.Name, netnsPath: h.Path(), inode: h.Inode(), opts: parsed.Options}
		t.check(ctx, uid, e, h)
		h.Close()
		t.mu.Lock()
		t.tracked[uid] = e
		t.mu.Unlock()
		verified++
	}
	t.log.Info("sidecar pods restored", "pods", len(targets), "verified", verified, "took", time.Since(start))
}

// VerifyPass reads back every tracked pod's rules and repairs those that
// drifted; pods whose sandbox is gone are forgotten.
func (t *Tracker) VerifyPass(ctx context.Context) {
	t.mu.Lock()
	list := make(map[string]entry, len(t.tracked))
	for uid, e := range t.tracked {
		list[uid] = e
	}
	t.mu.Unlock()
	for uid, e := range list {
		if ctx.Err() != nil {
			return
		}
		h, err := podnetns.Open(e.netnsPath)
		if err != nil || h.Inode() != e.inode {
			if h != nil {
				h.Close()
			}
			t.log.Debug("sidecar pod's sandbox is gone; forgotten", "namespace", e.namespace, "pod", e.name, "uid", uid)
			t.Forget(uid)
			continue
		}
		t.check(ctx, uid, e, h)
		h.Close()
	}
}

// check verifies one pod's rules and repairs them when they differ,
// counting and recording the repair.
func (t *Tracker) check(ctx context.Context, uid string, e entry, h *podnetns.Handle) {
	log := t.log.With("namespace", e.namespace, "pod", e.name)
	d, err := t.rules.VerifySidecar(ctx, h, e.opts)
	if err != nil {
		t.metrics.failures.Inc()
		log.Warn("verifying sidecar rules failed", "error", err)
		return
	}
	if d.Empty() {
		return
	}
	log.Warn("sidecar rules drifted; repairing", "drift", d.String())
	if err := t.rules.ApplySidecar(ctx, h, e.opts, nil); err != nil {
		t.metrics.failures.Inc()
		log.Warn("repairing sidecar rules failed", "error", err)
		return
	}
	t.metrics.repairs.Inc()
	log.Info("sidecar rules repaired")
	t.event(e.namespace, e.name, uid, EventRulesRepaired, "the pod's sidecar traffic redirection rules had drifted and were repaired: "+summary(d))
}

func summary(d iptables.Drift) string {
	s := fmt.Sprintf("%d missing, %d unexpected", len(d.Missing), len(d.Unexpected))
	if len(d.Missing) > 0 {
		s += "; first missing: " + strings.TrimSpace(d.Missing[0])
	}
	return s
}

// ErrNotSidecar: the repair controller asked to program a pod that Istio's
// skip order leaves alone (istio-init, no istio-proxy, a gateway,
// inject=false, DISABLE_ENVOY, no status annotation).
var ErrNotSidecar = errors.New("not a sidecar pod to capture")

// Repair programs the rules of a running sidecar pod that started without
// them (the repair controller found its istio-validation failed): its
// namespace is found by a /proc scan (the pod's uid and addresses), its
// rules applied there, and the pod tracked from then on. A pod the skip
// order leaves alone is not programmed (ErrNotSidecar; Istio's repair
// would program it anyway). As Istio's, it ignores the excluded namespaces:
// the plugin passed such a pod through, so nothing else will capture it.
func (t *Tracker) Repair(ctx context.Context, pod *corev1.Pod) error {
	if capture, skip := policy.SidecarDecision(pod); !capture {
		return fmt.Errorf("pod %s/%s: %w: %s", pod.Namespace, pod.Name, ErrNotSidecar, skip)
	}
	ips := podmeta.IPs(pod)
	if len(ips) == 0 {
		return fmt.Errorf("pod %s/%s has no IP yet", pod.Namespace, pod.Name)
	}
	h, err := t.finder.FindOne(ctx, podnetns.Target{UID: string(pod.UID), IPs: ips})
	if err != nil {
		return fmt.Errorf("pod %s/%s: finding its network namespace: %w", pod.Namespace, pod.Name, err)
	}
	defer h.Close()
	return t.capture(ctx, pod, h, ips)
}

// Skip is the error Repair returns for a pod not to program (the repair
// controller counts it as skipped).
func (t *Tracker) Skip() error { return ErrNotSidecar }
