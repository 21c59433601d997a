package nodeenv

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Istio's own node agent (istio-cni's install-cni: CNI installer + ambient
// node agent, and the istio-cni plugin) on this node, for the switch
// scenarios (test/e2eswitch). It is built from the test-only module
// test/istio-oracle at its pinned Istio revision by
// hack/istio-agent-image.sh (`make istio-agent-image`) and deployed from
// the Cni component Istio's own renderer produced
// (test/istio-oracle/testdata/cni/*.yaml, `make istio-oracle`), patched only
// where this node differs from a cluster (IstioAgentOverlay).
const (
	// IstioAgentImage is the reference hack/istio-agent-image.sh records;
	// its tag is the Istio revision's commit (IstioAgentTag).
	IstioAgentImage = "istio.local/e2e/install-cni"
	// IstioAgentDaemonSet is the name Istio's chart gives it (and the one
	// its shutdown check reads: "<name>-node").
	IstioAgentDaemonSet = "istio-cni-node"
	// IstioHealth is its readiness endpoint (/readyz on :8000; the agent
	// shares the node's network namespace, see IstioAgentVariant).
	IstioHealth = "http://127.0.0.1:8000"
)

// IstioAgentVariant names a rendering in test/istio-oracle/testdata/cni: both
// set the chart value cni.ambient.shareHostNetworkNamespace=true (the agent
// in the node's network namespace: here the default mode would enter the
// network namespace of the machine's pid 1, not the node's).
type IstioAgentVariant string

const (
	// IstioIPTables is the chart's default rule backend: iptables, legacy
	// or nft as Istio's agent detects at start.
	IstioIPTables IstioAgentVariant = "iptables"
	// IstioNFTables is Istio's native nftables mode
	// (values.global.nativeNftables=true).
	IstioNFTables IstioAgentVariant = "nftables"
)

// IstioAgentTag returns the image tag hack/istio-agent-image.sh gives Istio's
// agent: the commit of the Istio revision test/istio-oracle/go.mod pins.
func (n *Node) IstioAgentTag() (string, error) {
	p := filepath.Join(n.Env.Root, "test", "istio-oracle", "go.mod")
	b, err := os.ReadFile(p)
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "require" && f[1] == "istio.io/istio" {
			return f[2][strings.LastIndex(f[2], "-")+1:], nil
		}
	}
	return "", fmt.Errorf("%s: no `require istio.io/istio` line", p)
}

// IstioAgentImageArchive is `make istio-agent-image`'s output.
func (n *Node) IstioAgentImageArchive() (string, error) {
	p := filepath.Join(n.Env.Root, "bin", "istio-agent-image.tar")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("image of Istio's agent: %w (run `make istio-agent-image` first; `make e2e-switch` does)", err)
	}
	return p, nil
}

// WriteIstioAgentOverlay writes into dir a kustomization of Istio's rendered
// Cni component (variant v) for this node and returns dir. Only what this
// node needs changes: the image (imported, not pulled), the apiserver on
// loopback (there is no kube-proxy, so the `kubernetes` Service routes
// nowhere; the same patch ambientd's overlay has), readiness checked every
// second. Every other value is the chart's.
func (n *Node) WriteIstioAgentOverlay(dir string, v IstioAgentVariant) (string, error) {
	rendered, err := os.ReadFile(filepath.Join(n.Env.Root, "test", "istio-oracle", "testdata", "cni", string(v)+".yaml"))
	if err != nil {
		return "", fmt.Errorf("rendered Cni component of Istio: %w", err)
	}
	tag, err := n.IstioAgentTag()
	if err != nil {
		return "", err
	}
	u, err := url.Parse(n.Env.CP.URL)
	if err != nil {
		return "", err
	}
	files := map[string]string{
		"istio-cni.yaml": string(rendered),
		"kustomization.yaml": `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - istio-cni.yaml
patches:
  - path: agent.yaml
`,
		"agent.yaml": fmt.Sprintf(`apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: %s
  namespace: istio-system
spec:
  template:
    spec:
      containers:
        - name: install-cni
          image: %s:%s
          imagePullPolicy: Never
          env:
            - name: KUBERNETES_SERVICE_HOST
              value: %q
            - name: KUBERNETES_SERVICE_PORT
              value: %q
          readinessProbe:
            periodSeconds: 1
`, IstioAgentDaemonSet, IstioAgentImage, tag, u.Hostname(), u.Port()),
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return "", err
		}
	}
	return dir, nil
}

// IstioAgentPod returns the pod of Istio's agent DaemonSet (nil if none).
// ambientd's pods carry Istio's label k8s-app=istio-cni-node too (so
// Istio's tools find the node agent), hence app!=ambientd.
func (n *Node) IstioAgentPod(ctx context.Context) (*corev1.Pod, error) {
	pods, err := n.Env.CP.Admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=" + IstioAgentDaemonSet + ",app!=ambientd"})
	if err != nil || len(pods.Items) == 0 {
		return nil, err
	}
	return &pods.Items[0], nil
}
