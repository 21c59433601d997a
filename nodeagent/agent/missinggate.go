package agent

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// EventReadinessGateMissing is recorded once on a pod of this node that
// the agent enrolls and that admission would have given the readiness gate,
// but that has none: it was created while neither the admission policy nor
// the webhook acted (the webhook down — its failurePolicy is Ignore — or
// not installed, or the pod older than them). Such a pod is Ready
// without the mesh carrying it; recreating it (a rollout restart) adds the
// gate.
const EventReadinessGateMissing = "ReadinessGateMissing"

// missingGates remembers the pods the Event was recorded for, so that it is
// recorded once per pod; pods that left the cache are dropped at each
// count.
type missingGates struct {
	mu      sync.Mutex
	evented map[string]bool // uid
}

// lacksGate reports whether pod is running without the gate though
// admission would have given it one (wouldGate). Only a running pod can be
// Ready without the mesh's say.
func (a *Agent) lacksGate(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodRunning && a.wouldGate(pod)
}

// wouldGate reports whether admission would have gated pod (the agent's own
// enrollment rules and settings, the opt-out labels: admission.Decide) and
// it has no gate. Namespace labels come from the cache only: a namespace
// not there yet is not judged.
func (a *Agent) wouldGate(pod *corev1.Pod) bool {
	ns, err := a.nsLister.Get(pod.Namespace)
	if err != nil {
		return false
	}
	s := admission.Settings{Policy: a.cfg.Policy, ConditionType: a.cfg.PodConditionType}
	return s.Decide(pod, ns.Labels).AddGate
}

// reportMissingGate records the Event for a pod without the gate when it
// joins the mesh: the sync that moved it to enabled while it showed no True
// condition yet (publish calls it). Once per pod's life — an agent restart
// re-verifies pods that already show True and records nothing again (the
// gauge and `ambientd status` still count them) — and never for a pod that
// does not start.
func (a *Agent) reportMissingGate(s podSync, after registry.Entry, moved bool) {
	pod := s.pod
	if !a.cfg.MissingGateEvents || !moved || after.Phase != registry.Enabled || !s.inMesh || pod.DeletionTimestamp != nil || !a.wouldGate(pod) {
		return
	}
	if c := podCondition(pod, a.cfg.PodConditionType); c != nil && c.Status == corev1.ConditionTrue {
		return
	}
	uid := string(pod.UID)
	a.gates.mu.Lock()
	if a.gates.evented == nil {
		a.gates.evented = map[string]bool{}
	}
	first := !a.gates.evented[uid]
	a.gates.evented[uid] = true
	a.gates.mu.Unlock()
	if first {
		a.recorder.Event(refOf(pod.Namespace, pod.Name, uid), corev1.EventTypeWarning, EventReadinessGateMissing,
			fmt.Sprintf("the pod is in the ambient mesh but has no readiness gate %s: admission did not add it (the admission webhook or policy was down or absent when it was created), so it may be Ready before ztunnel carries it; recreate it to add the gate", a.cfg.PodConditionType))
	}
}

// countMissingGates counts this node's pods that lack the gate, and forgets
// the Events of pods no longer cached.
func (a *Agent) countMissingGates() float64 {
	n := 0
	cached := map[string]bool{}
	for _, obj := range a.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.DeletionTimestamp != nil {
			continue
		}
		cached[string(p.UID)] = true
		if a.lacksGate(p) {
			n++
		}
	}
	a.gates.mu.Lock()
	for uid := range a.gates.evented {
		if !cached[uid] {
			delete(a.gates.evented, uid)
		}
	}
	a.gates.mu.Unlock()
	return float64(n)
}

// missingGatesGauge is ambientd_pods_missing_readiness_gate.
func (a *Agent) missingGatesGauge() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "ambientd_pods_missing_readiness_gate",
		Help: "Pods of this node in the mesh that admission would have given the readiness gate but that have none (created while the admission webhook or policy did not act): Ready without the mesh's say.",
	}, a.countMissingGates)
}
