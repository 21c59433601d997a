package agent

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// writeRules programs the pod's rules in h: every write the agent makes.
func (a *Agent) writeRules(ctx context.Context, h *podnetns.Handle, opts iptables.PodOptions) error {
	if err := a.hostGuard(h, "apply pod rules"); err != nil {
		return err
	}
	a.metrics.ruleWrites.Inc()
	start := time.Now()
	err := a.rules.ApplyPod(ctx, h, opts)
	a.metrics.step(ctx, "rules", start)
	return err
}

// checkRules reads the pod's rules back and compares them with what it
// should have; only when they differ are they rewritten (an intact pod sees
// no write, so no rule churn and no traffic blip). It reports whether it
// wrote; an error wraps ErrNotCaptured (the pod's capture is not known to be
// in place). A pod being enrolled in a new sandbox (its old one changed)
// has no rules there yet: that is not drift, and neither counted nor
// reported as a repair.
func (a *Agent) checkRules(ctx context.Context, log *slog.Logger, e registry.Entry, opts iptables.PodOptions) (bool, error) {
	d, err := a.verifyRules(ctx, e.Netns, opts)
	if err != nil {
		a.metrics.failure("rules")
		return false, fmt.Errorf("%w: verify in-pod rules of %s/%s: %w", ErrNotCaptured, e.Namespace, e.Name, err)
	}
	if d.Empty() {
		return false, nil
	}
	newSandbox := e.Phase == registry.Uncaptured && e.Reason == ReasonSandboxChanged
	if !newSandbox {
		log.Warn("in-pod rules drifted; repairing", "missing", len(d.Missing), "unexpected", len(d.Unexpected), "drift", d.String())
	}
	if err := a.writeRules(ctx, e.Netns, opts); err != nil {
		a.metrics.failure("rules")
		return false, fmt.Errorf("%w: program in-pod rules of %s/%s: %w", ErrNotCaptured, e.Namespace, e.Name, err)
	}
	if newSandbox {
		log.Info("in-pod rules written in the pod's new sandbox", "netns", e.Netns.String())
		return true, nil
	}
	a.metrics.repairs.WithLabelValues("pod_rules").Inc()
	a.podEvent(e.UID, corev1.EventTypeWarning, EventRulesRepaired, "in-pod traffic redirection rules had drifted and were repaired: "+driftSummary(d))
	log.Info("in-pod rules repaired")
	return true, nil
}

// driftSummary is a short, bounded description of d for an event.
func driftSummary(d iptables.Drift) string {
	s := fmt.Sprintf("%d missing, %d unexpected", len(d.Missing), len(d.Unexpected))
	if len(d.Missing) > 0 {
		s += "; first missing: " + strings.TrimSpace(d.Missing[0])
	}
	return s
}

// The rule calls go through these, which refuse the node's own netns: pod
// rules are never written, read as a pod's or deleted there (with the
// nftables backend, deleting "a pod's" tables in the node's netns would
// delete the host's probe SNAT of every pod).
func (a *Agent) hostGuard(h *podnetns.Handle, what string) error {
	if h == nil {
		return fmt.Errorf("%s: no netns", what)
	}
	if a.finder.IsHost(h) {
		a.metrics.failure("host_netns")
		return fmt.Errorf("%s in netns %s: %w", what, h, podnetns.ErrHostNetns)
	}
	return nil
}

func (a *Agent) deleteRules(ctx context.Context, h *podnetns.Handle) error {
	if err := a.hostGuard(h, "delete pod rules"); err != nil {
		return err
	}
	return a.rules.DeletePod(ctx, h)
}

func (a *Agent) verifyRules(ctx context.Context, h *podnetns.Handle, opts iptables.PodOptions) (iptables.Drift, error) {
	if err := a.hostGuard(h, "verify pod rules"); err != nil {
		return iptables.Drift{}, err
	}
	return a.rules.VerifyPod(ctx, h, opts)
}
