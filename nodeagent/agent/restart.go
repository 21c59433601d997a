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

// rebuild refills the registry after a restart, before the ztunnel server
// starts, so a reconnecting ztunnel never drops a live pod. It verifies
// instead of trusting (docs/agent.md, "Restart and the state file"): the
// pods the policy puts in the mesh are found (state file, then one /proc
// pass), restored in the phase their annotation and sandbox allow, and
// their rules read back and repaired where they differ. Pods out of the
// mesh are never registered; rules the state file says they hold are
// deleted. The state file drops the records of pods gone from the node,
// and the probe set is pruned unless the picture is incomplete.
func (a *Agent) rebuild(ctx context.Context) {
	pic := a.restartPicture(ctx)
	start := time.Now()
	a.dropGoneRecords(pic.live)
	for _, p := range pic.stale {
		if err := a.cleanStale(ctx, p); err != nil {
			a.queue.AddRateLimited(string(p.UID)) // its sync retries the cleanup
		}
	}
	recorded := map[string]bool{}
	for _, t := range pic.targets {
		recorded[t.UID] = a.state != nil && a.state.Has(t.UID)
	}
	found, viaState, err := a.findNetns(ctx, pic.targets)
	if err != nil {
		a.log.Warn("scanning host proc for pod netns failed; pods not found are kept as uncaptured", "error", err)
		pic.complete = false
	}
	restored, missing := 0, 0
	var verify []string
	for _, c := range pic.cands {
		uid := string(c.pod.UID)
		h := found[uid]
		if h == nil {
			missing++
		}
		if !a.restore(c, h, viaState[uid], recorded[uid]) {
			continue
		}
		restored++
		if h != nil {
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
	if pic.complete {
		a.pruneProbes(ctx)
	} else {
		a.log.Warn("probe set not pruned: the restart's picture of the pods is incomplete")
	}
}

// restartCandidate is a pod a restart restores, with the options its rules
// are (to be) programmed with.
type restartCandidate struct {
	pod       *corev1.Pod
	annotated bool // enabled or pending
	opts      iptables.PodOptions
}

// restartPicture is what a restart knows of this node's pods from the
// cache.
type restartPicture struct {
	cands   []restartCandidate
	targets []podnetns.Target // the candidates' netns to find
	stale   []*corev1.Pod     // out of the mesh: rules the state file records go
	live    map[string]bool   // uids of the non-terminal pods
	// complete is false when a policy decision failed.
	complete bool
}

// restartPicture sorts this node's non-terminal pods: candidates are the
// pods the policy puts in the mesh, annotated enabled or pending or with
// IPs (the agent may have died before their annotation landed), and those
// it cannot decide about (an API error) that the state file records.
// hostNetwork pods are never candidates (the host is never a pod), nor is a
// pod out of the mesh, whatever its annotation claims, nor one whose
// annotations refuse its enrollment.
func (a *Agent) restartPicture(ctx context.Context) restartPicture {
	pic := restartPicture{live: map[string]bool{}, complete: true}
	defaults := podopts.Defaults(a.cfg.DNSCapture)
	for _, obj := range a.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		pic.live[string(p.UID)] = true
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
			pic.complete = false
			if !ours {
				continue // the reconcile decides again (and retries API errors)
			}
			// The agent's own record says it enrolled the pod: kept
			// when unsure, so ztunnel keeps serving it.
		case !d.InMesh:
			// Never registered on its annotation: any pod may claim
			// `enabled` about itself (docs/security.md). Rules the agent
			// put in it are found through its own record (cleanStale).
			pic.stale = append(pic.stale, p)
			continue
		}
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
		pic.cands = append(pic.cands, restartCandidate{pod: p, annotated: annotated, opts: opts})
		pic.targets = append(pic.targets, podnetns.Target{UID: string(p.UID), RuntimeUID: a.runtimeUID(p), IPs: podmeta.IPs(p)})
	}
	return pic
}

// dropGoneRecords drops the state file's records of pods no longer on the
// node (live holds those that are).
func (a *Agent) dropGoneRecords(live map[string]bool) {
	if a.state == nil {
		return
	}
	if dropped, err := a.state.Retain(func(uid string) bool { return live[uid] }); err != nil {
		a.log.Warn("dropping state records of pods gone while the agent was down", "error", err)
	} else if len(dropped) > 0 {
		a.log.Info("dropped state records of pods gone while the agent was down", "uids", dropped)
	}
}

// restore registers candidate c in the phase restoredPhase gives it, with
// its netns h (nil: not found); a pod to search again or whose sandbox
// changed is queued. False: it could not be registered.
func (a *Agent) restore(c restartCandidate, h *podnetns.Handle, viaState, recorded bool) bool {
	p := c.pod
	uid := string(p.UID)
	log := a.podLog(p.Namespace, p.Name, uid)
	st, lastErr, reason := a.restoredPhase(p, h != nil, viaState, recorded)
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
		return false
	}
	if c.annotated && (st.String() == p.Annotations[podmeta.AnnotationRedirection] || st == registry.Unserved) {
		a.moved.take(uid) // what the pod already shows: nothing to publish
	}
	log.Info("restored pod", "phase", st.String(), "netns_found", h != nil, "via_state_file", viaState, "annotated", c.annotated)
	if h == nil || reason == ReasonSandboxChanged {
		// Searched again now; a pod whose sandbox changed gets its
		// False written now, not only once a ztunnel acks.
		a.queue.Add(uid)
	}
	return true
}

// restoredPhase is the phase a restart restores pod p in: its annotation's
// (Unserved for an enabled pod that shows False/ZtunnelUnavailable;
// Unverified without one), except that a pod whose netns was not found is
// Uncaptured, and an enabled one is Pending unless its sandbox is the one
// it was enrolled in: the state file gave its netns (viaState), or without
// a record its True is not older than its sandbox (trueOlderThanSandbox).
func (a *Agent) restoredPhase(p *corev1.Pod, found, viaState, recorded bool) (st registry.Phase, lastErr, reason string) {
	st = registry.Unverified
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
	case !found:
		return registry.Uncaptured, "network namespace not found after the agent restarted; searching again", ReasonNetnsNotFound
	case (st == registry.Enabled || st == registry.Unserved) && !viaState && (recorded || a.trueOlderThanSandbox(p)):
		return registry.Pending, "the pod's sandbox changed while the agent was down (its enrolled condition predates it); re-enrolling it", ReasonSandboxChanged
	}
	return st, lastErr, reason
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
