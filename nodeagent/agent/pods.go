package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/podmeta"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/policy"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// podLog returns the agent's logger with the pod's identity on every line.
func (a *Agent) podLog(namespace, name, uid string) *slog.Logger {
	return a.log.With("namespace", namespace, "pod", name, "uid", uid)
}

// podByUID returns the cached pod with uid, or nil.
func (a *Agent) podByUID(uid string) *corev1.Pod {
	objs, err := a.podInformer.GetIndexer().ByIndex(uidIndex, uid)
	if err != nil || len(objs) == 0 {
		return nil
	}
	p, _ := objs[0].(*corev1.Pod)
	return p
}

// podByName returns the cached pod namespace/name, or nil.
func (a *Agent) podByName(namespace, name string) *corev1.Pod {
	obj, ok, err := a.podInformer.GetIndexer().GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	p, _ := obj.(*corev1.Pod)
	return p
}

func (a *Agent) namespaceLabels(ctx context.Context, name string) (map[string]string, error) {
	if n, err := a.nsLister.Get(name); err == nil {
		return n.Labels, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := a.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get namespace %s: %w", name, err)
	}
	return n.Labels, nil
}

// decide applies the enrollment policy to pod.
func (a *Agent) decide(ctx context.Context, pod *corev1.Pod) (policy.Decision, error) {
	labels, err := a.namespaceLabels(ctx, pod.Namespace)
	if err != nil && !apierrors.IsNotFound(errors.Unwrap(err)) {
		return policy.Decision{}, err
	}
	return a.cfg.Policy.Decide(pod, labels), nil
}

// rebuild fills the registry after a restart, with one /proc pass for all the
// pods' namespaces, so a reconnecting ztunnel never drops a live pod:
//
//   - this node's pods annotated enabled or pending are registered in that
//     state; those whose netns is not found are still registered (ztunnel
//     gets Keep for them). Their rules are left alone.
//   - this node's other running (non-terminal) pods that the policy puts in
//     the mesh are registered as pending when their netns is found: the agent
//     may have died after ztunnel took such a pod but before its annotation
//     landed (the patch is queued, e.g. during an API outage). They are
//     Unverified, so the sync that follows applies their rules (a no-op when
//     they are in place) before sending a fresh Add. Those whose netns is
//     not found are left to that reconcile: a Keep for a pod ztunnel may never
//     have had is pointless.
func (a *Agent) rebuild(ctx context.Context) {
	type candidate struct {
		pod       *corev1.Pod
		annotated bool
	}
	var cands []candidate
	var targets []podnetns.Target
	for _, obj := range a.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			continue
		}
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		annotated := false
		switch p.Annotations[podmeta.AnnotationRedirection] {
		case podmeta.RedirectionEnabled, podmeta.RedirectionPending:
			annotated = true
		}
		if !annotated {
			if len(podIPs(p)) == 0 {
				continue // no sandbox network yet: its CNI ADD is still to come
			}
			d, err := a.decide(ctx, p)
			if err != nil || !d.InMesh {
				continue // the reconcile decides again (and retries API errors)
			}
			if _, err := podmeta.PodOptions(a.cfg.DNSCapture, p.Annotations); err != nil {
				continue // never enrollable as it is; the reconcile reports it
			}
		}
		cands = append(cands, candidate{pod: p, annotated: annotated})
		targets = append(targets, podnetns.Target{UID: string(p.UID), IPs: podIPs(p)})
	}
	if len(cands) == 0 {
		return
	}
	start := time.Now()
	found, err := a.finder.Find(ctx, targets)
	if err != nil {
		a.log.Warn("scanning host proc for pod netns failed; annotated pods will be kept as they are", "error", err)
		found = nil
	}
	restored, unannotated := 0, 0
	for _, c := range cands {
		p := c.pod
		h := found[string(p.UID)]
		log := a.podLog(p.Namespace, p.Name, string(p.UID))
		if !c.annotated && h == nil {
			log.Info("in-mesh pod without annotation: netns not found, left to the reconcile")
			continue
		}
		st := registry.Unverified
		switch p.Annotations[podmeta.AnnotationRedirection] {
		case podmeta.RedirectionEnabled:
			st = registry.Enabled
		case podmeta.RedirectionPending:
			st = registry.Pending
		}
		sa := p.Spec.ServiceAccountName
		if sa == "" {
			sa = "default"
		}
		// Not a.update: restoring what the pod already shows moves nothing
		// the cluster should hear about.
		if _, err := a.reg.Update(string(p.UID), func(e *registry.Entry) {
			*e = registry.Entry{
				UID: string(p.UID), Name: p.Name, Namespace: p.Namespace, ServiceAccount: sa,
				IPs: podIPs(p), Netns: h, Phase: st,
			}
		}); err != nil {
			log.Warn("restoring pod", "error", err)
			continue
		}
		restored++
		if !c.annotated {
			unannotated++
		}
		log.Info("restored pod", "state", st.String(), "netns_found", h != nil, "annotated", c.annotated)
	}
	a.log.Info("registry rebuilt", "pods", restored, "unannotated", unannotated, "netns_found", len(found), "took", time.Since(start))
}

// Snapshot implements ztunnel.SnapshotSource from the registry.
func (a *Agent) Snapshot() []ztunnel.SnapshotEntry {
	list := a.reg.List()
	out := make([]ztunnel.SnapshotEntry, 0, len(list))
	for _, e := range list {
		if e.Phase == registry.Releasing {
			continue // being dropped: a new ztunnel must not take it
		}
		out = append(out, ztunnel.SnapshotEntry{
			Workload: ztunnel.Workload{UID: e.UID, Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount},
			Netns:    e.Netns,
		})
	}
	return out
}

func podIPs(p *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && p.Status.PodIP != "" {
		if a, err := netip.ParseAddr(p.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}
