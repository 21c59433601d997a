// Package repair is the repair controller of sidecar mode: it watches this
// node's pods for an injected pod whose istio-validation init container
// failed with the code that means "traffic not redirected" (126) — the pod
// started without the node agent's plugin in its chain, or its rules were
// lost — and repairs it: programs its rules (mode repair, the default; the
// pod recovers when kubelet restarts the init container), deletes it (mode
// delete; its controller recreates it, through the plugin this time) or
// labels it (mode label). Istio's behaviour, label, Event reasons and metric
// (docs/sidecar.md). The informer → workqueue → one idempotent reconcile
// shape of sample-controller; no logic in the event handlers.
package repair

import (
	"context"
	"errors"
	"fmt"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambientd/ambientd/podmeta"
)

// Mode is what the controller does with a broken pod.
type Mode string

const (
	// ModeRepair programs the pod's rules in its running sandbox (needs no
	// extra rights).
	ModeRepair Mode = "repair"
	// ModeDelete deletes the pod (needs the repair-delete component).
	ModeDelete Mode = "delete"
	// ModeLabel labels it LabelKey=LabelValue through pods/status (needs
	// the repair-label component).
	ModeLabel Mode = "label"
	// ModeOff turns the controller off.
	ModeOff Mode = "off"
)

// ParseMode accepts repair, delete, label and off.
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case ModeRepair, ModeDelete, ModeLabel, ModeOff:
		return Mode(s), nil
	}
	return "", fmt.Errorf("repair mode %q: want repair, delete, label or off", s)
}

// Istio's Event reasons, recorded on the pod (source component cni-repair).
const (
	EventDeleteBrokenPod = "DeleteBrokenPod"
	EventLabelBrokenPod  = "LabelBrokenPod"
	// EventRepairBrokenPod is ours (Istio's repair mode records none): the
	// pod's rules were programmed by the repair controller.
	EventRepairBrokenPod = "RepairBrokenPod"
	// EventComponent is the Events' source component, Istio's.
	EventComponent = "cni-repair"
)

// Config configures the controller; DefaultConfig holds Istio's defaults.
type Config struct {
	NodeName string
	Mode     Mode
	// LabelKey and LabelValue are what label mode sets.
	LabelKey, LabelValue string
	// SidecarAnnotation must be on the pod ("" : any pod).
	SidecarAnnotation string
	// InitContainerName is the validation container ("" : any init
	// container); InitExitCode the failure code (0: any);
	// InitTerminationMessage, when set, must equal its message.
	InitContainerName      string
	InitExitCode           int32
	InitTerminationMessage string
	// LabelSelector and FieldSelector further restrict the pods (the
	// field selector over metadata.name, metadata.namespace,
	// spec.nodeName, spec.serviceAccountName and status.phase).
	LabelSelector, FieldSelector string
	// MaxAttempts bounds the retries of one pod (Istio: 5).
	MaxAttempts int
}

// DefaultConfig is Istio's defaults (its chart's repair.* values).
func DefaultConfig() Config {
	return Config{
		Mode:              ModeRepair,
		LabelKey:          podmeta.LabelBrokenPod,
		LabelValue:        "true",
		SidecarAnnotation: podmeta.AnnotationSidecarStatus,
		InitContainerName: podmeta.ContainerValidation,
		InitExitCode:      126,
		MaxAttempts:       5,
	}
}

// Repairer programs a running sidecar pod's rules (*sidecar.Tracker).
// An error wrapping the error its Skip method returns means the pod is not
// one to program (retrying cannot help).
type Repairer interface {
	Repair(ctx context.Context, pod *corev1.Pod) error
}

// skipper is a Repairer that says which of its errors mean "not to repair".
type skipper interface{ Skip() error }

// Controller is the repair controller.
type Controller struct {
	cfg      Config
	client   kube.Interface
	pods     cache.SharedIndexInformer
	repairer Repairer
	recorder record.EventRecorder
	log      *slog.Logger
	queue    workqueue.TypedRateLimitingInterface[types.NamespacedName]
	labelSel labels.Selector
	fieldSel fields.Selector
	repaired *prometheus.CounterVec

	mu sync.Mutex
	// done remembers the pods repair mode repaired (name -> uid), so a pod
	// is programmed once (Istio's behaviour); dropped with the pod.
	done map[types.NamespacedName]types.UID
}

// New builds the controller over the agent's informer of this node's pods.
// reg gets the metric (Istio's name).
func New(cfg Config, client kube.Interface, pods cache.SharedIndexInformer, repairer Repairer, recorder record.EventRecorder,
	reg prometheus.Registerer, log *slog.Logger) (*Controller, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if _, err := ParseMode(string(cfg.Mode)); err != nil {
		return nil, err
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 5
	}
	c := &Controller{
		cfg: cfg, client: client, pods: pods, repairer: repairer, recorder: recorder, log: log.With("component", "repair"),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](200*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[types.NamespacedName]{Name: "repair pods"}),
		done: map[types.NamespacedName]types.UID{},
	}
	var err error
	if c.labelSel, err = labels.Parse(cfg.LabelSelector); err != nil {
		return nil, fmt.Errorf("repair label selector %q: %w", cfg.LabelSelector, err)
	}
	if c.fieldSel, err = fields.ParseSelector(cfg.FieldSelector); err != nil {
		return nil, fmt.Errorf("repair field selector %q: %w", cfg.FieldSelector, err)
	}
	if cfg.Mode == ModeRepair && repairer == nil {
		return nil, errors.New("repair mode needs the sidecar mode's repairer")
	}
	c.repaired = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "istio_cni_repair_pods_repaired_total",
		Help: "Pods the repair controller acted on (Istio's metric): type repair, delete or label; result success, fail or skip.",
	}, []string{"type", "result"})
	if reg != nil {
		if err := reg.Register(c.repaired); err != nil {
			return nil, err
		}
	}
	if cfg.Mode == ModeOff {
		return c, nil
	}
	// Handlers only enqueue; the decisions are in reconcile.
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueue,
		UpdateFunc: func(_, obj any) { c.enqueue(obj) },
		DeleteFunc: c.enqueue,
	}); err != nil {
		return nil, fmt.Errorf("repair: pod event handler: %w", err)
	}
	return c, nil
}

func (c *Controller) enqueue(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if p, ok := obj.(*corev1.Pod); ok {
		c.queue.Add(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	}
}

// Run reconciles queued pods until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	if c.cfg.Mode == ModeOff {
		<-ctx.Done()
		return nil
	}
	context.AfterFunc(ctx, c.queue.ShutDown)
	if !cache.WaitForCacheSync(ctx.Done(), c.pods.HasSynced) {
		return nil
	}
	c.log.Info("repair controller running", "mode", string(c.cfg.Mode), "node", c.cfg.NodeName)
	for {
		key, quit := c.queue.Get()
		if quit {
			return nil
		}
		err := c.Reconcile(ctx, key)
		switch {
		case err == nil || ctx.Err() != nil:
			c.queue.Forget(key)
		case c.queue.NumRequeues(key)+1 >= c.cfg.MaxAttempts:
			c.log.Warn("giving up on broken pod", "namespace", key.Namespace, "pod", key.Name, "attempts", c.cfg.MaxAttempts, "error", err)
			c.queue.Forget(key)
		default:
			c.queue.AddRateLimited(key)
		}
		c.queue.Done(key)
	}
}

// Reconcile acts on one pod if it is broken; idempotent.
func (c *Controller) Reconcile(ctx context.Context, key types.NamespacedName) error {
	obj, ok, err := c.pods.GetStore().GetByKey(key.String())
	if err != nil {
		return err
	}
	if !ok {
		c.mu.Lock()
		delete(c.done, key)
		c.mu.Unlock()
		return nil
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok || !c.Broken(pod) {
		return nil
	}
	switch c.cfg.Mode {
	case ModeRepair:
		return c.repair(ctx, key, pod)
	case ModeDelete:
		return c.delete(ctx, pod)
	case ModeLabel:
		return c.label(ctx, pod)
	}
	return nil
}

// Broken reports whether pod is one the controller acts on: on this node,
// matching the selectors, with the sidecar annotation, and with the
// validation init container not (yet) succeeded after a run that ended
// with the failure code (and message): Istio's match.
func (c *Controller) Broken(pod *corev1.Pod) bool {
	if c.cfg.NodeName != "" && pod.Spec.NodeName != c.cfg.NodeName {
		return false
	}
	if !c.labelSel.Matches(labels.Set(pod.Labels)) || !c.fieldSel.Matches(podFields(pod)) {
		return false
	}
	if c.cfg.SidecarAnnotation != "" {
		if _, ok := pod.Annotations[c.cfg.SidecarAnnotation]; !ok {
			return false
		}
	}
	for _, s := range pod.Status.InitContainerStatuses {
		if c.cfg.InitContainerName != "" && s.Name != c.cfg.InitContainerName {
			continue
		}
		if t := s.State.Terminated; t != nil && (t.Reason == "Completed" || t.ExitCode == 0) {
			continue // it has passed since
		}
		t := s.LastTerminationState.Terminated
		if t == nil {
			continue
		}
		msg := strings.TrimSpace(c.cfg.InitTerminationMessage)
		if (c.cfg.InitExitCode == 0 || t.ExitCode == c.cfg.InitExitCode) && (msg == "" || msg == strings.TrimSpace(t.Message)) {
			return true
		}
	}
	return false
}

func podFields(p *corev1.Pod) fields.Set {
	return fields.Set{
		"metadata.name": p.Name, "metadata.namespace": p.Namespace, "spec.nodeName": p.Spec.NodeName,
		"spec.serviceAccountName": p.Spec.ServiceAccountName, "status.phase": string(p.Status.Phase),
	}
}

func (c *Controller) event(pod *corev1.Pod, reason, msg string) {
	if c.recorder != nil {
		c.recorder.Event(pod, corev1.EventTypeWarning, reason, msg)
	}
}

func (c *Controller) count(typ string, err error) {
	result := "success"
	if err != nil {
		result = "fail"
	}
	c.repaired.WithLabelValues(typ, result).Inc()
}

// repair programs the pod's rules in its running sandbox, once per pod.
func (c *Controller) repair(ctx context.Context, key types.NamespacedName, pod *corev1.Pod) error {
	c.mu.Lock()
	uid, done := c.done[key]
	c.mu.Unlock()
	if done {
		if uid != pod.UID {
			c.log.Warn("skipping pod repaired before under another uid", "namespace", key.Namespace, "pod", key.Name, "uid", pod.UID, "repaired_uid", uid)
		}
		return nil
	}
	log := c.log.With("namespace", pod.Namespace, "pod", pod.Name)
	log.Info("pod detected as broken (istio-validation failed), repairing its rules")
	err := c.repairer.Repair(ctx, pod)
	if s, ok := c.repairer.(skipper); ok && err != nil && errors.Is(err, s.Skip()) {
		c.repaired.WithLabelValues("repair", "skip").Inc()
		log.Info("not repairing pod", "error", err)
		c.mu.Lock()
		c.done[key] = pod.UID
		c.mu.Unlock()
		return nil
	}
	c.count("repair", err)
	if err != nil {
		log.Warn("repairing pod failed", "error", err)
		return fmt.Errorf("repair pod %s: %w", key, err)
	}
	c.mu.Lock()
	c.done[key] = pod.UID
	c.mu.Unlock()
	c.event(pod, EventRepairBrokenPod, "pod detected as broken, its traffic redirection programmed; it recovers when its istio-validation container runs again")
	log.Info("pod repaired")
	return nil
}

// delete deletes the pod, only the version that was judged broken.
func (c *Controller) delete(ctx context.Context, pod *corev1.Pod) error {
	c.log.Info("pod detected as broken (istio-validation failed), deleting", "namespace", pod.Namespace, "pod", pod.Name)
	uid, rv := pod.UID, pod.ResourceVersion
	err := c.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv},
	})
	if apierrors.IsNotFound(err) {
		return nil
	}
	c.count("delete", err)
	if err != nil {
		c.event(pod, EventDeleteBrokenPod, fmt.Sprintf("pod detected as broken, but failed to delete: %v", err))
		return err
	}
	c.event(pod, EventDeleteBrokenPod, "pod detected as broken, deleted")
	return nil
}

// label sets LabelKey=LabelValue on the pod through pods/status.
func (c *Controller) label(ctx context.Context, pod *corev1.Pod) error {
	if _, ok := pod.Labels[c.cfg.LabelKey]; ok {
		c.repaired.WithLabelValues("label", "skip").Inc()
		return nil
	}
	c.log.Info("pod detected as broken (istio-validation failed), labelling", "namespace", pod.Namespace, "pod", pod.Name, "label", c.cfg.LabelKey)
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, c.cfg.LabelKey, c.cfg.LabelValue)
	_, err := c.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
	c.count("label", err)
	if err != nil {
		c.event(pod, EventLabelBrokenPod, fmt.Sprintf("pod detected as broken, but failed to label: %v", err))
		return err
	}
	c.event(pod, EventLabelBrokenPod, "pod detected as broken, labeled")
	return nil
}
