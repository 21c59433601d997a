// Package shutdownrule tells, when the agent stops, an uninstall from an
// upgrade or restart, from its DaemonSet as the API shows it and as the agent
// last watched it.
package shutdownrule

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/ambientd/ambientd/nodeagent/kube"
)

// Rule decides, when the agent stops, whether this is an uninstall
// or an upgrade/restart. The rule (Istio's agent follows the first part): if
// the agent's DaemonSet still exists, is not being deleted, is not in a
// namespace being deleted and still selects this node, another agent pod is
// coming — leave the plugin, config, host rules and pod rules in place, so
// new ambient pods wait for it instead of starting uncaptured. Otherwise
// (DaemonSet gone, being deleted, or no longer scheduling here) the node is
// being left: uninstall.
//
// The agent's identity is part of the installation. An uninstall deletes it
// too, and usually first (`kubectl delete -k deploy/` deletes the
// ServiceAccount and the RBAC binding before the DaemonSet, and the agents
// get SIGTERM after that), leaving the agent unable to ask. But a refused
// identity does not prove an uninstall either: a force-deleted agent pod
// (its bound token dies with it) or a recreated ServiceAccount gets the same
// 401 while the DaemonSet stays and a replacement is coming — removing the
// plugin then lets new ambient pods start uncaptured under the replacement.
// So the agent keeps a watch on its DaemonSet open while it runs (Watch):
// an established watch keeps delivering after the identity that opened it
// is deleted, so it sees the DaemonSet's deletion that follows. At
// shutdown, a 401/403 means uninstall only when that watch saw the
// DaemonSet deleted, being deleted or no longer selecting the node; when
// the last it saw was the DaemonSet alive and selecting the node, it means
// "the agent pod or its identity went, the DaemonSet stays": keep. Without
// a first read (the API was never reachable, or the deployment never
// granted the read) a 401/403 proves nothing. Anything else the agent
// cannot get an answer to (network, timeouts, 5xx) is an error, with
// uninstall=false: when in doubt, keep the node protected (a leftover
// plugin fails closed; a missing one fails open). See docs/install.md.
type Rule struct {
	client                         kube.Interface
	namespace, daemonSet, nodeName string
	// readOnce: the agent read its DaemonSet at least once (any answer
	// but 401/403), so its identity and rights worked.
	readOnce atomic.Bool
	// seen is the last state of the DaemonSet the agent read or watched.
	seen atomic.Pointer[seenDS]
	// watching: a watch of the DaemonSet is established right now.
	watching atomic.Bool
}

// Watching reports whether the rule's watch of the DaemonSet is
// established right now.
func (r *Rule) Watching() bool { return r.watching.Load() }

// seenDS is what the agent last learnt of its DaemonSet: gone (deleted,
// or not found), or the object.
type seenDS struct {
	at   time.Time
	gone bool
	ds   *appsv1.DaemonSet
}

// New returns the rule for the agent's DaemonSet
// namespace/daemonSet on node nodeName, read with client (the agent's own
// identity). Call Probe (or Watch) at start.
func New(client kube.Interface, namespace, daemonSet, nodeName string) *Rule {
	return &Rule{client: client, namespace: namespace, daemonSet: daemonSet, nodeName: nodeName}
}

// Probe reads the DaemonSet once and returns nil when the API answered with
// anything but 401/403 (a missing DaemonSet is an answer): from then on a
// 401/403 at shutdown means the identity or its rights were deleted.
func (r *Rule) Probe(ctx context.Context) error {
	ds, err := r.client.AppsV1().DaemonSets(r.namespace).Get(ctx, r.daemonSet, metav1.GetOptions{})
	if err == nil || apierrors.IsNotFound(err) {
		r.readOnce.Store(true)
		r.seen.Store(&seenDS{at: time.Now(), gone: err != nil, ds: ds})
		return nil
	}
	return fmt.Errorf("reading DaemonSet %s/%s: %w", r.namespace, r.daemonSet, err)
}

// follow watches the DaemonSet from resourceVersion rv until the watch
// ends or ctx does, recording every state it sees.
func (r *Rule) follow(ctx context.Context, rv string) error {
	w, err := r.client.AppsV1().DaemonSets(r.namespace).Watch(ctx, metav1.ListOptions{
		FieldSelector:   "metadata.name=" + r.daemonSet,
		ResourceVersion: rv,
	})
	if err != nil {
		return err
	}
	defer w.Stop()
	r.watching.Store(true)
	defer r.watching.Store(false)
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.ResultChan():
			if !ok {
				return errors.New("watch closed")
			}
			ds, isDS := ev.Object.(*appsv1.DaemonSet)
			switch {
			case ev.Type == watch.Deleted:
				r.seen.Store(&seenDS{at: time.Now(), gone: true})
			case isDS && (ev.Type == watch.Added || ev.Type == watch.Modified):
				r.seen.Store(&seenDS{at: time.Now(), ds: ds})
			case ev.Type == watch.Error:
				return fmt.Errorf("watch error: %v", apierrors.FromObject(ev.Object))
			}
		}
	}
}

// Watch probes until a probe succeeds or ctx ends, backing off from 1s to
// 30s, and logs each failure: an agent that cannot read its DaemonSet
// cannot tell an uninstall from an upgrade and keeps the plugin at
// shutdown.
//
// Once the probe worked it keeps a watch on the DaemonSet open until ctx
// ends (re-reading and re-watching when a watch ends), so that the rule
// knows the DaemonSet's last state even after the agent's identity is gone.
func (r *Rule) Watch(ctx context.Context, log *slog.Logger) {
	probed := false
	for backoff := time.Second; ; backoff = min(2*backoff, 30*time.Second) {
		err := r.Probe(ctx)
		if err == nil {
			if !probed {
				probed = true
				backoff = time.Second
			}
			rv := ""
			if s := r.seen.Load(); s != nil && s.ds != nil {
				rv = s.ds.ResourceVersion
			}
			err = r.follow(ctx, rv)
			if err == nil || ctx.Err() != nil {
				return
			}
			log.Debug("the agent's DaemonSet watch ended; watching again", "error", err, "retry_in", backoff)
		} else if ctx.Err() == nil {
			if probed {
				log.Debug("cannot read the agent's DaemonSet again", "error", err, "retry_in", backoff)
			} else {
				log.Warn("cannot read the agent's DaemonSet; until it can, stopping the agent never uninstalls (docs/install.md)", "error", err, "retry_in", backoff)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// Decide applies the rule. reason says why, for the log.
func (r *Rule) Decide(ctx context.Context) (uninstall bool, reason string, err error) {
	what := fmt.Sprintf("DaemonSet %s/%s", r.namespace, r.daemonSet)
	ds, err := r.client.AppsV1().DaemonSets(r.namespace).Get(ctx, r.daemonSet, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return true, what + " is gone", nil
	}
	if gone, why := r.identityGone(err); gone {
		return r.decideFromWatch(ctx, what, why)
	}
	if err != nil {
		return false, "", fmt.Errorf("reading %s: %w", what, err)
	}
	if ds.DeletionTimestamp != nil {
		return true, what + " is being deleted", nil
	}
	// Deleting the namespace deletes the DaemonSet's pods and the
	// DaemonSet in no set order: the pods may stop first.
	ns, err := r.client.CoreV1().Namespaces().Get(ctx, r.namespace, metav1.GetOptions{})
	if gone, why := r.identityGone(err); gone {
		return true, "reading namespace " + r.namespace + ": " + why, nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading namespace %s: %w", r.namespace, err)
	}
	if ns.DeletionTimestamp != nil {
		return true, fmt.Sprintf("namespace %s of %s is being deleted", r.namespace, what), nil
	}
	node, err := r.client.CoreV1().Nodes().Get(ctx, r.nodeName, metav1.GetOptions{})
	if gone, why := r.identityGone(err); gone {
		return true, "reading node " + r.nodeName + ": " + why, nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading node %s: %w", r.nodeName, err)
	}
	ok, err := selectsNode(&ds.Spec.Template.Spec, node)
	if err != nil {
		return false, "", fmt.Errorf("%s node selection: %w", what, err)
	}
	if !ok {
		return true, fmt.Sprintf("%s no longer selects node %s", what, r.nodeName), nil
	}
	return false, fmt.Sprintf("%s still selects node %s (upgrade or restart)", what, r.nodeName), nil
}

// decideFromWatch: the API refuses the agent's identity, which worked
// before. What the watch last saw of the DaemonSet decides: deleted, being
// deleted or no longer selecting this node → uninstall; alive and selecting
// it → the agent pod or its identity went while the DaemonSet stays (a
// force-deleted pod, a recreated ServiceAccount): keep, a replacement is
// coming.
func (r *Rule) decideFromWatch(ctx context.Context, what, why string) (bool, string, error) {
	s := r.seen.Load()
	switch {
	case s == nil:
		return false, "", fmt.Errorf("reading %s: %s, and the agent never saw its DaemonSet", what, why)
	case s.gone:
		return true, fmt.Sprintf("%s; the agent saw %s deleted at %s", why, what, s.at.UTC().Format(time.RFC3339)), nil
	case s.ds.DeletionTimestamp != nil:
		return true, fmt.Sprintf("%s; the agent saw %s being deleted at %s", why, what, s.at.UTC().Format(time.RFC3339)), nil
	}
	if node, err := r.client.CoreV1().Nodes().Get(ctx, r.nodeName, metav1.GetOptions{}); err == nil {
		if ok, err := selectsNode(&s.ds.Spec.Template.Spec, node); err == nil && !ok {
			return true, fmt.Sprintf("%s; %s as last seen no longer selects node %s", why, what, r.nodeName), nil
		}
	}
	return false, fmt.Sprintf("%s, but %s was there and selected this node when last seen (%s): the agent pod or its identity went while the DaemonSet stays (a force-deleted pod, a recreated ServiceAccount); keeping the plugin for its replacement", why, what, s.at.UTC().Format(time.RFC3339)), nil
}

// identityGone reports whether err is the API saying that the agent's
// identity or its rights, which worked before, are gone: only an uninstall
// does that to a running agent.
func (r *Rule) identityGone(err error) (bool, string) {
	if !r.readOnce.Load() {
		return false, ""
	}
	switch {
	case apierrors.IsUnauthorized(err):
		return true, "the agent's credentials are no longer accepted (its ServiceAccount was deleted or recreated, or its pod was deleted): " + err.Error()
	case apierrors.IsForbidden(err):
		return true, "the agent's rights are gone (its ClusterRole or binding was deleted): " + err.Error()
	}
	return false, ""
}

// selectsNode evaluates the pod template's nodeSelector and required node
// affinity against the node's labels (taints: the DaemonSet tolerates all).
func selectsNode(spec *corev1.PodSpec, node *corev1.Node) (bool, error) {
	nodeLabels := labels.Set(node.Labels)
	if !labels.SelectorFromSet(spec.NodeSelector).Matches(nodeLabels) {
		return false, nil
	}
	if spec.Affinity == nil || spec.Affinity.NodeAffinity == nil || spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return true, nil
	}
	terms := spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	for _, term := range terms { // terms are ORed, expressions within one ANDed
		sel := labels.NewSelector()
		for _, e := range term.MatchExpressions {
			r, err := labels.NewRequirement(e.Key, nodeOp(e.Operator), e.Values)
			if err != nil {
				return false, err
			}
			sel = sel.Add(*r)
		}
		fieldsOK := true
		for _, f := range term.MatchFields {
			if f.Key == "metadata.name" {
				r, err := labels.NewRequirement("metadata.name", nodeOp(f.Operator), f.Values)
				if err != nil {
					return false, err
				}
				fieldsOK = fieldsOK && labels.NewSelector().Add(*r).Matches(labels.Set{"metadata.name": node.Name})
			}
		}
		if fieldsOK && sel.Matches(nodeLabels) {
			return true, nil
		}
	}
	return len(terms) == 0, nil
}

func nodeOp(op corev1.NodeSelectorOperator) selection.Operator {
	switch op {
	case corev1.NodeSelectorOpIn:
		return selection.In
	case corev1.NodeSelectorOpNotIn:
		return selection.NotIn
	case corev1.NodeSelectorOpExists:
		return selection.Exists
	case corev1.NodeSelectorOpDoesNotExist:
		return selection.DoesNotExist
	case corev1.NodeSelectorOpGt:
		return selection.GreaterThan
	case corev1.NodeSelectorOpLt:
		return selection.LessThan
	}
	return selection.Operator(op)
}
