// Package findsagent holds the tests that Istio's own tools, run from the
// Istio release this module pins, find ambientd's node agent as they find
// Istio's: istiod's node untaint controller
// (pilot/pkg/controllers/untaint) and istioctl bug-report's collection of
// the CNI agent's pods (tools/bug-report/pkg/cluster). Both select the
// agent's pods by the label k8s-app=istio-cni-node, which the chart puts on
// the agent's pods (ambientd.istioCniNodeLabel).
package findsagent

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"istio.io/istio/pilot/pkg/controllers/untaint"
	kubelib "istio.io/istio/pkg/kube"
	"istio.io/istio/tools/bug-report/pkg/cluster"
	"istio.io/istio/tools/bug-report/pkg/config"
)

const (
	namespace = "istio-system"
	taintKey  = "cni.istio.io/not-ready" // PILOT_NODE_UNTAINT_CONTROLLERS_TAINT_NAME's default
)

// agentPod is a running, Ready pod of the DaemonSet the chart renders with
// its default values: deploy/daemonset.yaml, which test/helm holds equal to
// the chart's render byte for byte.
func agentPod(t *testing.T, node string) *corev1.Pod {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "..", "deploy", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(b, &ds); err != nil {
		t.Fatalf("deploy/daemonset.yaml: %v", err)
	}
	tpl := ds.Spec.Template
	spec := tpl.Spec.DeepCopy()
	spec.NodeName = node
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: ds.Name + "-x7k2p", Namespace: namespace, Labels: tpl.Labels, Annotations: tpl.Annotations},
		Spec:       *spec,
		Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue},
		}},
	}
}

func taintedNode(name string) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: taintKey, Effect: corev1.TaintEffectNoSchedule}}},
	}
}

// istioctl bug-report collects the logs of the CNI agent's pods it finds
// by their label: with the chart's defaults it finds ambientd's agent;
// without the label (ambientd.istioCniNodeLabel=false) it does not.
func TestBugReportFindsTheAgent(t *testing.T) {
	for _, tt := range []struct {
		name      string
		dropLabel bool
		want      bool
	}{
		{"chart defaults", false, true},
		{"label turned off", true, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pod := agentPod(t, "node-a")
			if tt.dropLabel {
				delete(pod.Labels, "k8s-app")
			}
			client := kubelib.NewFakeClient(pod)
			res, err := cluster.GetClusterResources(context.Background(), client.Kube(), &config.BugReportConfig{IstioNamespace: namespace})
			if err != nil {
				t.Fatal(err)
			}
			_, found := res.CniPod[cluster.PodKey(namespace, pod.Name)]
			if found != tt.want {
				t.Errorf("bug-report's CNI pods %v: agent pod %s/%s (labels %v) found = %v, want %v", keysOf(res.CniPod), namespace, pod.Name, pod.Labels, found, tt.want)
			}
		})
	}
}

// istiod's node untaint controller (PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS)
// removes the startup taint from a node once the CNI agent's pod there is
// Ready: it recognises ambientd's agent pod rendered by the chart.
func TestUntaintControllerFindsTheAgent(t *testing.T) {
	pod := agentPod(t, "node-a")
	client := kubelib.NewFakeClient(taintedNode("node-a"), pod)
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	nt := untaint.NewNodeUntainter(stop, client, namespace, namespace, nil)
	go nt.Run(stop)
	client.RunAndWait(stop)

	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := client.Kube().CoreV1().Nodes().Get(context.Background(), "node-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(n.Spec.Taints) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30s node-a still has taints %v: Istio's untaint controller did not take the agent pod (labels %v) for its CNI agent", n.Spec.Taints, pod.Labels)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func keysOf[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}
