package nodeready

import (
	"encoding/json"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
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
