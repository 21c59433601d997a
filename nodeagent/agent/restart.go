package agent

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// rebuild fills the registry after a restart, so a reconnecting ztunnel
// never drops a live pod, and verifies instead of trusting:
//
//   - this node's running pods the policy puts in the mesh, annotated
//     enabled or pending or not (the agent may have died before their
//     annotation landed), and those the policy cannot decide about (an API
//     error) that the state file records, are looked up: state file first
//     (its netns checked to hold one of the pod's IPs and not to be the
//     node's), then one /proc pass for the rest. hostNetwork pods are never
//     candidates, whatever their annotations: the host is never a pod.
//   - found: registered (annotated ones in their annotated phase,
//     unannotated ones Unverified), and every one still in the mesh has its
//     sandbox checked and its rules read back and repaired only where they
//     differ, before the ztunnel server starts; a pod that cannot be
//     repaired is Uncaptured. An `enabled` pod is restored Enabled only when
//     its sandbox is the one it was enrolled in: the state file recorded
//     that very netns, or (no record) the agent's True condition is not
//     older than kubelet's PodReadyToStartContainers (the sandbox's start).
//     Otherwise it is Pending — a True older than the pod's sandbox is not
//     trusted — and enrolled again.
//   - not found: registered as Uncaptured with no netns (ztunnel gets Keep:
//     it may serve the pod), never enabled meanwhile; their syncs search
//     again with backoff and Add them afresh once found.
//   - Pods out of the mesh are never registered, whatever their
//     annotation says (a pod may claim `enabled` about itself): nothing of
//     theirs reaches ztunnel. Those the state file still records (they
//     left the mesh while the agent was down, or were caught mid-enrollment)
//     have their rules deleted here (cleanStale; a failure is retried by
//     their sync, which also takes a stale annotation off).
//
// The state file drops the records of pods no longer on the node. Finally
// the probe set is pruned to the pods whose rules are in place, unless the
// picture is incomplete (the /proc scan or a policy decision failed).
func (a *Agent) rebuild(ctx context.Context) {
	type candidate struct {
		pod       *corev1.Pod
		annotated bool
		inMesh    bool
		opts      iptables.PodOptions
	}
	var cands []candidate
	var targets []podnetns.Target
	var stale []*corev1.Pod // out of the mesh, unannotated
	live := map[string]bool{}
	complete := true
	defaults := podopts.Defaults(a.cfg.DNSCapture)
	for _, obj := range a.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			continue
		}
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		live[string(p.UID)] = true
		if p.Spec.HostNetwork {
			continue // the host is never a pod: never restored, looked up or cleaned
		}
		annotated := false
		switch p.Annotations[podmeta.AnnotationRedirection] {
		case podmeta.RedirectionEnabled, podmeta.RedirectionPending:
			annotated = true
		}
		if !annotated && len(podmeta.IPs(p)) == 0 {
			continue // no sandbox network yet: its CNI ADD is still to come
		}
		d, err := a.decide(ctx, p)
		switch ours := a.state != nil && a.state.Has(string(p.UID)); {
		case err != nil:
			complete = false
			if !ours {
				continue // the reconcile decides again (and retries API errors)
			}
			// The agent's own record says it enrolled the pod: kept
			// when unsure, so ztunnel keeps serving it.
		case !d.InMesh:
			// Never registered on its annotation: any pod may claim
			// `enabled` about itself (docs/security.md). Rules the agent
			// put in it are found through its own record (cleanStale).
			stale = append(stale, p)
			continue
		}
		inMesh := true
		base, recorded := defaults, false
		if a.state != nil {
			if o, ok := a.state.Options(string(p.UID)); ok {
				base, recorded = o, true // what its rules were programmed with
			}
		}
		opts, invalid := podopts.Options(defaults, base, p.Annotations)
		if refuses(recorded || annotated, invalid) != nil {
			continue // never enrollable as it is; the reconcile reports it
		}
		cands = append(cands, candidate{pod: p, annotated: annotated, inMesh: inMesh, opts: opts})
		targets = append(targets, podnetns.Target{UID: string(p.UID), RuntimeUID: a.runtimeUID(p), IPs: podmeta.IPs(p)})
	}
	start := time.Now()
	if a.state != nil {
		if dropped, err := a.state.Retain(func(uid string) bool { return live[uid] }); err != nil {
			a.log.Warn("dropping state records of pods gone while the agent was down", "error", err)
		} else if len(dropped) > 0 {
			a.log.Info("dropped state records of pods gone while the agent was down", "uids", dropped)
		}
	}
	for _, p := range stale {
		if err := a.cleanStale(ctx, p); err != nil {
			a.queue.AddRateLimited(string(p.UID)) // its sync retries the cleanup
		}
	}
	recorded := map[string]bool{}
	for _, t := range targets {
		recorded[t.UID] = a.state != nil && a.state.Has(t.UID)
	}
	found, viaState, err := a.findNetns(ctx, targets)
	if err != nil {
		a.log.Warn("scanning host proc for pod netns failed; pods not found are kept as uncaptured", "error", err)
		complete = false
	}
	restored, missing := 0, 0
	var verify []string
	for _, c := range cands {
		p := c.pod
		uid := string(p.UID)
		h := found[uid]
		log := a.podLog(p.Namespace, p.Name, uid)
		st, lastErr, reason := registry.Unverified, "", ""
		switch p.Annotations[podmeta.AnnotationRedirection] {
		case podmeta.RedirectionEnabled:
			st = registry.Enabled
			if c := podCondition(p, a.cfg.PodConditionType); c != nil && c.Status == corev1.ConditionFalse && c.Reason == ReasonZtunnelUnavailable {
				// Unserved when the agent stopped: no ztunnel has it
				// until one acks a snapshot (with the pod in it).
				st, lastErr, reason = registry.Unserved, c.Message, ReasonZtunnelUnavailable
			}
		case podmeta.RedirectionPending:
			st = registry.Pending
		}
		switch {
		case h == nil:
			st, lastErr, reason = registry.Uncaptured, "network namespace not found after the agent restarted; searching again", ReasonNetnsNotFound
			missing++
		case (st == registry.Enabled || st == registry.Unserved) && !viaState[uid] && (recorded[uid] || a.trueOlderThanSandbox(p)):
			st, reason = registry.Pending, ReasonSandboxChanged
			lastErr = "the pod's sandbox changed while the agent was down (its enrolled condition predates it); re-enrolling it"
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
				IPs: podmeta.IPs(p), Netns: h, Phase: st, LastError: lastErr, Reason: reason, Options: c.opts,
			}
		}); err != nil {
			log.Warn("restoring pod", "error", err)
			continue
		}
		if c.annotated && (st.String() == p.Annotations[podmeta.AnnotationRedirection] || st == registry.Unserved) {
			a.moved.take(uid) // what the pod already shows: nothing to publish
		}
		restored++
		log.Info("restored pod", "phase", st.String(), "netns_found", h != nil, "via_state_file", viaState[uid], "annotated", c.annotated)
		if h == nil || reason == ReasonSandboxChanged {
			// Searched again now; a pod whose sandbox changed gets its
			// False written now, not only once a ztunnel acks.
			a.queue.Add(uid)
		}
		if h != nil && c.inMesh {
			verify = append(verify, uid)
			if !viaState[uid] {
				// Found by the /proc scan: recorded now, so a later
				// restart finds it — and cleans it if it left the mesh
				// meanwhile — through the agent's own record.
				a.recordNetns(uid, h, c.opts)
			}
		}
	}
	if trustRestored {
		verify = nil // the known-bad build of restartverify_trust.go
	}
	a.verifyAll(ctx, verify)
	a.log.Info("registry rebuilt", "pods", restored, "netns_not_found", missing, "verified", len(verify), "took", time.Since(start))
	if complete {
		a.pruneProbes(ctx)
	} else {
		a.log.Warn("probe set not pruned: the restart's picture of the pods is incomplete")
	}
}

// trueOlderThanSandbox reports whether pod's enrolled condition is True
// since before kubelet last reported the pod's sandbox ready to start
// containers (PodReadyToStartContainers moves when a new sandbox gets its
// network): that True was written for an earlier sandbox. The API keeps
// both times to the second, so a sandbox recreated within the second of the
// True is not told apart here (the state file tells it).
func (a *Agent) trueOlderThanSandbox(pod *corev1.Pod) bool {
	ours := podCondition(pod, a.cfg.PodConditionType)
	sandbox := podCondition(pod, string(corev1.PodReadyToStartContainers))
	if ours == nil || sandbox == nil || ours.Status != corev1.ConditionTrue || sandbox.Status != corev1.ConditionTrue {
		return false
	}
	return ours.LastTransitionTime.Before(&sandbox.LastTransitionTime)
}

// cleanStale deletes the rules of a pod out of the mesh and unregistered
// whose netns the state file still records: the agent was enrolling or
// removing it when it stopped (e.g. its namespace's label went while it
// was down), so it may hold our rules, which nothing else would remove.
// Only the state file is consulted (no /proc scan of every out-of-mesh pod);
// a pod it does not know never got rules from this node's agent. A recorded
// netns that is gone, or no longer holds the pod's IPs, took our rules with
// it. An error leaves the record, so the pod's sync retries.
func (a *Agent) cleanStale(ctx context.Context, p *corev1.Pod) error {
	uid := string(p.UID)
	if a.state == nil || !a.state.Has(uid) {
		return nil
	}
	log := a.podLog(p.Namespace, p.Name, uid)
	h, ok := a.state.Open(uid)
	if !ok {
		a.forgetNetns(uid) // its netns is gone, and our rules with it
		return nil
	}
	if err := a.finder.Accept(h, podmeta.IPs(p)); err != nil {
		h.Close()
		log.Info("the recorded netns is no longer the pod's; record dropped", "error", err)
		a.forgetNetns(uid)
		return nil
	}
	err := a.deleteRules(ctx, h)
	h.Close()
	if err != nil {
		a.metrics.failure("removal")
		log.Warn("cannot delete the rules of a pod that left the mesh while the agent was down; retried", "error", err)
		return fmt.Errorf("pod %s/%s: delete the rules it kept while out of the mesh: %w", p.Namespace, p.Name, err)
	}
	a.forgetNetns(uid)
	log.Info("deleted the rules of a pod that left the mesh while the agent was down")
	return nil
}
