package nodeready

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
)

// hasTaint reports whether taints has key, with any effect.
func hasTaint(taints []corev1.Taint, key string) bool {
	return slices.ContainsFunc(taints, func(t corev1.Taint) bool { return t.Key == key })
}

// withoutTaint returns taints minus every taint with key (any effect: a
// node pool may register the startup taint as NoSchedule or NoExecute).
func withoutTaint(taints []corev1.Taint, key string) []corev1.Taint {
	out := make([]corev1.Taint, 0, len(taints))
	for _, t := range taints {
		if t.Key != key {
			out = append(out, t)
		}
	}
	return out
}

// withTaint returns taints plus key:NoSchedule, unchanged if key is there
// with any effect.
func withTaint(taints []corev1.Taint, key string) []corev1.Taint {
	if hasTaint(taints, key) {
		return taints
	}
	return append(slices.Clone(taints), corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule})
}

type jsonPatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// taintPatch builds a JSON patch that changes spec.taints from have to
// want, and applies only while spec.taints is still exactly have: the
// `test` op makes the apiserver refuse it when anyone edited the taints in
// between (we then re-read and rebuild), so their edit is never lost.
// An absent taints array is tested as null.
func taintPatch(have, want []corev1.Taint) ([]byte, error) {
	var test any = have
	if len(have) == 0 {
		test = nil
	}
	ops := []jsonPatchOp{{Op: "test", Path: "/spec/taints", Value: test}}
	switch {
	case len(have) == 0:
		ops = append(ops, jsonPatchOp{Op: "add", Path: "/spec/taints", Value: want})
	case len(want) == 0:
		ops = append(ops, jsonPatchOp{Op: "remove", Path: "/spec/taints"})
	default:
		ops = append(ops, jsonPatchOp{Op: "replace", Path: "/spec/taints", Value: want})
	}
	b, err := json.Marshal(ops)
	if err != nil {
		return nil, fmt.Errorf("marshal taint patch: %w", err)
	}
	return b, nil
}

// conditionPatch builds the strategic-merge patch of nodes/status that sets
// one condition: conditions merge by type, so kubelet's are untouched.
func conditionPatch(c corev1.NodeCondition) ([]byte, error) {
	b, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{c}}})
	if err != nil {
		return nil, fmt.Errorf("marshal condition patch: %w", err)
	}
	return b, nil
}

// taintAction is what the taint needs on a node: none, remove or add.
type taintAction int

const (
	taintKeep taintAction = iota
	taintRemove
	taintAdd
)

// decideTaint returns the taint action for node n given the current
// condition, and (for a pending re-taint) when to look again.
func (c *Controller) decideTaint(n *corev1.Node, ready bool, now time.Time) (taintAction, time.Duration) {
	cond := findCondition(n, corev1.NodeConditionType(c.cfg.ConditionType))
	present := hasTaint(n.Spec.Taints, c.cfg.TaintKey)
	manage := c.cfg.Untaint || c.cfg.TaintWhenUnready
	switch {
	case cond == nil:
		return taintKeep, 0
	case cond.Status == corev1.ConditionTrue && ready && present && manage:
		// Both: the written condition (what others see) and this
		// process's own verdict — a True left by an earlier agent
		// while a False settles (Config.Settle) removes nothing.
		return taintRemove, 0
	case cond.Status == corev1.ConditionFalse && !present && c.cfg.TaintWhenUnready:
		due, wait := retaintDue(cond, falseSince(cond, c.wroteTransition), c.cfg.TaintGracePeriod, now)
		if due {
			return taintAdd, 0
		}
		return taintKeep, wait
	}
	return taintKeep, 0
}

// reconcileTaint applies decideTaint with a conditional patch, re-reading
// the node and deciding again whenever the taints changed under us.
func (c *Controller) reconcileTaint(ctx context.Context, n *corev1.Node, ready bool) (time.Duration, error) {
	var after time.Duration
	var done taintAction
	err := retry.OnError(retry.DefaultRetry, isPatchConflict, func() error {
		act, wait := c.decideTaint(n, ready, c.now())
		after, done = wait, act
		if act == taintKeep {
			return nil
		}
		want := withoutTaint(n.Spec.Taints, c.cfg.TaintKey)
		if act == taintAdd {
			want = withTaint(n.Spec.Taints, c.cfg.TaintKey)
		}
		p, err := taintPatch(n.Spec.Taints, want)
		if err != nil {
			return err
		}
		got, err := c.client.CoreV1().Nodes().Patch(ctx, c.cfg.NodeName, types.JSONPatchType, p, metav1.PatchOptions{})
		if err != nil {
			if isPatchConflict(err) {
				// Someone edited the taints: re-read and decide again.
				if fresh, gerr := c.client.CoreV1().Nodes().Get(ctx, c.cfg.NodeName, metav1.GetOptions{}); gerr == nil {
					n = fresh
				}
			}
			return err
		}
		n = got
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("patch node %s taint %s: %w", c.cfg.NodeName, c.cfg.TaintKey, err)
	}
	c.ours = n
	switch done {
	case taintRemove:
		c.log.Info("startup taint removed", "taint", c.cfg.TaintKey)
		c.rec.Eventf(nodeRef(n), corev1.EventTypeNormal, EventTaintRemoved, "Removed taint %s: %s is True", c.cfg.TaintKey, c.cfg.ConditionType)
	case taintAdd:
		c.log.Warn("taint added back", "taint", c.cfg.TaintKey, "grace", c.cfg.TaintGracePeriod)
		c.rec.Eventf(nodeRef(n), corev1.EventTypeWarning, EventTaintAdded, "Added taint %s:NoSchedule: %s False for over %s", c.cfg.TaintKey, c.cfg.ConditionType, c.cfg.TaintGracePeriod)
	}
	c.mu.Lock()
	c.status.TaintPresent = hasTaint(n.Spec.Taints, c.cfg.TaintKey)
	c.mu.Unlock()
	return after, nil
}

// isPatchConflict: a failed `test` op is answered 422 (Invalid) by the
// apiserver, a resourceVersion race 409 (Conflict).
func isPatchConflict(err error) bool {
	return apierrors.IsConflict(err) || apierrors.IsInvalid(err)
}
