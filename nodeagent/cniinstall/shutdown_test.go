package cniinstall

import (
	"context"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
)

// The decision rule only (pure logic over API objects); the e2e suite reads
// a real DaemonSet with the agent's real rights.
func TestUninstallOnShutdown(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"kubernetes.io/os": "linux", "pool": "a"}}}
	ds := func(mut func(*appsv1.DaemonSet)) *appsv1.DaemonSet {
		d := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "ambientd", Namespace: "istio-system"}}
		d.Spec.Template.Spec.NodeSelector = map[string]string{"kubernetes.io/os": "linux"}
		if mut != nil {
			mut(d)
		}
		return d
	}
	now := metav1.Now()
	affinity := func(op corev1.NodeSelectorOperator, vals ...string) func(*appsv1.DaemonSet) {
		return func(d *appsv1.DaemonSet) {
			d.Spec.Template.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
				RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{
					{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "pool", Operator: op, Values: vals}}},
				}},
			}}
		}
	}
	cases := []struct {
		name string
		ds   *appsv1.DaemonSet
		want bool
	}{
		{"daemonset gone", nil, true},
		{"daemonset being deleted", ds(func(d *appsv1.DaemonSet) { d.DeletionTimestamp = &now; d.Finalizers = []string{"x"} }), true},
		{"upgrade: still selects the node", ds(nil), false},
		{"node selector no longer matches", ds(func(d *appsv1.DaemonSet) { d.Spec.Template.Spec.NodeSelector["pool"] = "b" }), true},
		{"affinity matches", ds(affinity(corev1.NodeSelectorOpIn, "a")), false},
		{"affinity excludes the node", ds(affinity(corev1.NodeSelectorOpNotIn, "a")), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			objs := []runtime.Object{node}
			if tc.ds != nil {
				objs = append(objs, tc.ds)
			}
			got, reason, err := UninstallOnShutdown(context.Background(), fake.NewClientset(objs...), "istio-system", "ambientd", "n1")
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want || reason == "" {
				t.Fatalf("uninstall=%v (%q), want %v", got, reason, tc.want)
			}
		})
	}
}
