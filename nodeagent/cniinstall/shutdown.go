package cniinstall

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/kubernetes"
)

// UninstallOnShutdown decides, when the agent stops, whether this is an
// uninstall or an upgrade/restart. The rule (the one Istio's agent follows):
// if the agent's DaemonSet still exists, is not being deleted and still
// selects this node, another agent pod is coming — leave the plugin, config,
// host rules and pod rules in place, so new ambient pods wait for it instead
// of starting uncaptured. Otherwise (DaemonSet gone, being deleted, or no
// longer scheduling here) the node is being left: uninstall.
//
// An API error is returned with uninstall=false: when in doubt, keep the
// node protected (a leftover plugin fails closed; a missing one fails open).
func UninstallOnShutdown(ctx context.Context, client kubernetes.Interface, namespace, daemonSet, nodeName string) (uninstall bool, reason string, err error) {
	ds, err := client.AppsV1().DaemonSets(namespace).Get(ctx, daemonSet, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return true, fmt.Sprintf("DaemonSet %s/%s is gone", namespace, daemonSet), nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading DaemonSet %s/%s: %w", namespace, daemonSet, err)
	}
	if ds.DeletionTimestamp != nil {
		return true, fmt.Sprintf("DaemonSet %s/%s is being deleted", namespace, daemonSet), nil
	}
	node, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return false, "", fmt.Errorf("reading node %s: %w", nodeName, err)
	}
	ok, err := selectsNode(&ds.Spec.Template.Spec, node)
	if err != nil {
		return false, "", fmt.Errorf("DaemonSet %s/%s node selection: %w", namespace, daemonSet, err)
	}
	if !ok {
		return true, fmt.Sprintf("DaemonSet %s/%s no longer selects node %s", namespace, daemonSet, nodeName), nil
	}
	return false, fmt.Sprintf("DaemonSet %s/%s still selects node %s (upgrade or restart)", namespace, daemonSet, nodeName), nil
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
