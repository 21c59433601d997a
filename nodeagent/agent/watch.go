package agent

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	"k8s.io/client-go/listers"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/podmeta"
)

// uidIndex indexes the pod cache by pod uid (podByUID).
const uidIndex = "uid"

// watch adds the agent's transforms, indexers and event handlers to the
// shared informers: this node's pods, every namespace (their labels enroll
// pods) and every RuntimeClass. im counts the events under Istio's names.
func (a *Agent) watch(informers *kube.Informers, im *istiometrics.Metrics) error {
	a.podInformer = informers.Pods
	// The cache keeps only what the agent reads of a pod (podmeta.Trim):
	// the rest is most of its heap at hundreds of pods (docs/scale.md).
	trim := podmeta.Trim(corev1.PodConditionType(a.cfg.PodConditionType), corev1.PodReadyToStartContainers)
	if err := a.podInformer.SetTransform(trim); err != nil {
		return fmt.Errorf("agent: pod informer transform: %w", err)
	}
	if err := a.podInformer.AddIndexers(cache.Indexers{uidIndex: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok {
			return []string{string(p.UID)}, nil
		}
		return nil, nil
	}}); err != nil {
		return fmt.Errorf("agent: add pod uid index: %w", err)
	}
	a.metrics.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "ambientd_informer_pods",
		Help: "Pods of this node in the agent's informer cache.",
	}, func() float64 { return float64(len(a.podInformer.GetStore().ListKeys())) }))
	a.metrics.reg.MustRegister(a.missingGatesGauge())
	a.nsInformer = informers.Namespaces
	if err := a.nsInformer.SetTransform(trim); err != nil {
		return fmt.Errorf("agent: namespace informer transform: %w", err)
	}
	a.nsLister = listers.New[*corev1.Namespace](a.nsInformer.GetIndexer(), corev1.Resource("namespace"))
	// RuntimeClasses: the handler a pod runs under decides whether the
	// rules can capture it. Not waited for at start: a lookup the cache
	// cannot answer is a direct GET.
	if err := informers.RuntimeClasses.SetTransform(trim); err != nil {
		return fmt.Errorf("agent: RuntimeClass informer transform: %w", err)
	}
	a.rcLister = listers.New[*nodev1.RuntimeClass](informers.RuntimeClasses.GetIndexer(), nodev1.Resource("runtimeclass"))

	// Event handlers only enqueue keys; all decisions happen in sync.
	// Every event is counted under Istio's name, as Istio's agent counts
	// each pod and namespace event it reconciles.
	if _, err := a.podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { im.ReconcileEvent(istiometrics.EventAdd); a.enqueuePod(obj) },
		UpdateFunc: func(_, obj any) {
			im.ReconcileEvent(istiometrics.EventUpdate)
			a.enqueuePod(obj)
		},
		DeleteFunc: func(obj any) { im.ReconcileEvent(istiometrics.EventDelete); a.enqueuePod(obj) },
	}); err != nil {
		return fmt.Errorf("agent: pod event handler: %w", err)
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
		return fmt.Errorf("agent: namespace event handler: %w", err)
	}
	return nil
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
