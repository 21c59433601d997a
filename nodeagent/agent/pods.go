package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/iptables"
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

// rebuild fills the registry after a restart, so a reconnecting ztunnel
// never drops a live pod, and verifies instead of trusting:
//
//   - this node's running pods annotated enabled or pending, and its other
//     running pods the policy puts in the mesh (the agent may have died
//     before their annotation landed), are looked up: state file first,
//     then one /proc pass for the rest.
//   - found: registered (annotated ones in their annotated phase,
//     unannotated ones Unverified), and every one still in the mesh has its
//     rules read back and repaired only where they differ, before the
//     ztunnel server starts; a pod that cannot be repaired is pending.
//     Annotated pods out of the mesh are left to their sync, which deletes
//     their rules; unannotated ones the state file still records (caught
//     mid-enrollment) have their rules deleted here (cleanStale).
//   - not found: registered as Pending with no netns (ztunnel gets Keep:
//     it may serve the pod), never enabled meanwhile; their syncs search
//     again with backoff and Add them afresh once found.
//
// Finally the probe set is pruned to the enabled pods, unless the picture
// is incomplete (the /proc scan or a policy decision failed).
func (a *Agent) rebuild(ctx context.Context) {
	type candidate struct {
		pod       *corev1.Pod
		annotated bool
		inMesh    bool
	}
	var cands []candidate
	var targets []podnetns.Target
	var stale []*corev1.Pod // out of the mesh, unannotated
	complete := true
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
		if !annotated && len(podIPs(p)) == 0 {
			continue // no sandbox network yet: its CNI ADD is still to come
		}
		d, err := a.decide(ctx, p)
		if err != nil {
			complete = false
			if !annotated {
				continue // the reconcile decides again (and retries API errors)
			}
		}
		inMesh := err != nil || d.InMesh // an annotated pod is kept when unsure
		if !annotated && !inMesh {
			stale = append(stale, p)
			continue
		}
		if _, err := podmeta.PodOptions(a.cfg.DNSCapture, p.Annotations); err != nil && !annotated {
			continue // never enrollable as it is; the reconcile reports it
		}
		cands = append(cands, candidate{pod: p, annotated: annotated, inMesh: inMesh})
		targets = append(targets, podnetns.Target{UID: string(p.UID), IPs: podIPs(p)})
	}
	start := time.Now()
	a.cleanStale(ctx, stale)
	found, err := a.findNetns(ctx, targets)
	if err != nil {
		a.log.Warn("scanning host proc for pod netns failed; pods not found are kept as pending", "error", err)
		complete = false
	}
	restored, missing := 0, 0
	var verify []string
	opts := map[string]iptables.PodOptions{}
	for _, c := range cands {
		p := c.pod
		uid := string(p.UID)
		h := found[uid]
		log := a.podLog(p.Namespace, p.Name, uid)
		st, lastErr := registry.Unverified, ""
		switch p.Annotations[podmeta.AnnotationRedirection] {
		case podmeta.RedirectionEnabled:
			st = registry.Enabled
		case podmeta.RedirectionPending:
			st = registry.Pending
		}
		if h == nil {
			st, lastErr = registry.Pending, "network namespace not found after the agent restarted; searching again"
			missing++
		}
		sa := p.Spec.ServiceAccountName
		if sa == "" {
			sa = "default"
		}
		// a.update records the move, so the pod's first sync publishes the
		// status of a pod restored as something else than it shows.
		if _, err := a.update(uid, func(e *registry.Entry) {
			*e = registry.Entry{
				UID: uid, Name: p.Name, Namespace: p.Namespace, ServiceAccount: sa,
				IPs: podIPs(p), Netns: h, Phase: st, LastError: lastErr,
			}
		}); err != nil {
			log.Warn("restoring pod", "error", err)
			continue
		}
		if c.annotated && st.String() == p.Annotations[podmeta.AnnotationRedirection] {
			a.moved.take(uid) // what the pod already shows: nothing to publish
		}
		restored++
		log.Info("restored pod", "state", st.String(), "netns_found", h != nil, "annotated", c.annotated)
		if h == nil {
			a.queue.Add(uid)
			continue
		}
		if o, err := podmeta.PodOptions(a.cfg.DNSCapture, p.Annotations); err == nil && c.inMesh {
			opts[uid] = o
			verify = append(verify, uid)
		}
	}
	a.verifyAll(ctx, verify, opts)
	a.log.Info("registry rebuilt", "pods", restored, "netns_not_found", missing, "verified", len(verify), "took", time.Since(start))
	if complete {
		a.pruneProbes(ctx)
	} else {
		a.log.Warn("probe set not pruned: the restart's picture of the pods is incomplete")
	}
}

// cleanStale deletes the rules of pods out of the mesh and unannotated
// whose netns the state file still records: the agent was enrolling or
// removing them when it stopped (e.g. their namespace's label went while it
// was down), so they may hold our rules, which nothing else would remove.
// Only the state file is consulted (no /proc scan of every out-of-mesh pod);
// a pod it does not know never got rules from this node's agent.
func (a *Agent) cleanStale(ctx context.Context, pods []*corev1.Pod) {
	if a.state == nil {
		return
	}
	for _, p := range pods {
		uid := string(p.UID)
		if !a.state.Has(uid) {
			continue
		}
		log := a.podLog(p.Namespace, p.Name, uid)
		h, ok := a.state.Open(uid)
		if !ok {
			a.forgetNetns(uid) // its netns is gone, and our rules with it
			continue
		}
		err := a.rules.DeletePod(ctx, h)
		h.Close()
		if err != nil {
			a.metrics.failure("removal")
			log.Warn("cannot delete the rules of a pod that left the mesh while the agent was down; its sync does not retry", "error", err)
			continue
		}
		a.forgetNetns(uid)
		log.Info("deleted the rules of a pod that left the mesh while the agent was down")
	}
}

// findNetns looks the targets' namespaces up: the state file first (the
// namespace its CNI ADD recorded, if still there), then one /proc scan for
// the rest. The caller owns the handles.
func (a *Agent) findNetns(ctx context.Context, targets []podnetns.Target) (map[string]*podnetns.Handle, error) {
	found := map[string]*podnetns.Handle{}
	var rest []podnetns.Target
	for _, t := range targets {
		if a.state != nil {
			if h, ok := a.state.Open(t.UID); ok {
				found[t.UID] = h
				continue
			}
		}
		rest = append(rest, t)
	}
	if len(rest) == 0 {
		return found, nil
	}
	scanned, err := a.finder.Find(ctx, rest)
	maps.Copy(found, scanned)
	return found, err
}

// recordNetns notes pod uid's namespace in the state file (best effort: the
// /proc scan remains).
func (a *Agent) recordNetns(uid string, h *podnetns.Handle) {
	if a.state == nil || h == nil {
		return
	}
	if err := a.state.Put(uid, h); err != nil {
		a.log.Warn("recording pod netns in the state file", "uid", uid, "error", err)
	}
}

// forgetNetns drops pod uid from the state file.
func (a *Agent) forgetNetns(uid string) {
	if a.state == nil {
		return
	}
	if err := a.state.Delete(uid); err != nil {
		a.log.Warn("removing pod netns from the state file", "uid", uid, "error", err)
	}
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
