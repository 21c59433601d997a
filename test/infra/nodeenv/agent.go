package nodeenv

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	cnins "github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
)

// What ambientd's own DaemonSet (deploy/) looks like on this node. The
// real-node tests and the demo share these.
const (
	// AgentImage is the reference `make image` records in its archive
	// (bin/ambientd-image.tar); AgentTag is its tag (not "latest": the
	// overlay also sets imagePullPolicy: Never, there is no registry).
	AgentImage = "ghcr.io/ambientd/ambientd"
	AgentTag   = "dev"
	// ZtunnelSocket is the agent's ZDS socket on the node (deploy/'s hostPath
	// /var/run/ztunnel, a tmpfs in the node's mount namespace).
	ZtunnelSocket = "/run/ztunnel/ztunnel.sock"
	// AgentHealth is the agent's health endpoint: the agent runs in the host
	// network, which is the node netns.
	AgentHealth = "http://127.0.0.1:8000"
	// EnrolledCondition is the readiness gate the agent sets on ambient pods.
	EnrolledCondition = corev1.PodConditionType("ambient.istio.io/enrolled")
	// Conflist is the node's CNI config file (in CNIConfDir), into which the
	// agent inserts its plugin.
	Conflist = "10-ambientd-node.conflist"
	// ProbeSNATAddr is where kubelet's probes of an enrolled pod come from
	// (the agent's host rules SNAT them past the capture).
	ProbeSNATAddr = "169.254.7.127"
)

// StartupTaint is the agent's startup taint: kubelet registers the node with
// it (Options.RegisterTaints), and only the agent, once it can mesh pods,
// removes it.
var StartupTaint = corev1.Taint{Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule}

// WriteAgentOverlay writes into dir a kustomize overlay on the repository's
// deploy/ for this node and returns dir: the locally imported image with tag
// (pull policy Never: there is no registry), the apiserver on loopback (there
// is no kube-proxy, so the `kubernetes` Service routes nowhere), readiness
// checked every second (so measured times are not 5-second steps).
func (n *Node) WriteAgentOverlay(dir, tag string) (string, error) {
	return n.WriteAgentOverlayEnv(dir, tag, nil)
}

// WriteAgentOverlayEnv is WriteAgentOverlay with more environment variables
// for the agent's container (settings beyond deploy/'s ConfigMap, e.g.
// AMBIENTD_HANDOVER), sorted by name.
func (n *Node) WriteAgentOverlayEnv(dir, tag string, env map[string]string) (string, error) {
	u, err := url.Parse(n.Env.CP.URL)
	if err != nil {
		return "", err
	}
	base, err := filepath.Rel(dir, filepath.Join(n.Env.Root, "deploy"))
	if err != nil {
		return "", err
	}
	files := map[string]string{
		"kustomization.yaml": fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
images:
  - name: %s
    newTag: %s
patches:
  - path: agent.yaml
`, base, AgentImage, tag),
		"agent.yaml": fmt.Sprintf(`apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ambientd
  namespace: istio-system
spec:
  template:
    spec:
      containers:
        - name: ambientd
          imagePullPolicy: Never
          env:
            - name: KUBERNETES_SERVICE_HOST
              value: %q
            - name: KUBERNETES_SERVICE_PORT
              value: %q
%s          readinessProbe:
            periodSeconds: 1
`, u.Hostname(), u.Port(), envYAML(env)),
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

// envYAML renders env as container env entries (indented for the overlay).
func envYAML(env map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(env)) {
		fmt.Fprintf(&b, "            - name: %s\n              value: %q\n", k, env[k])
	}
	return b.String()
}

// AgentImageArchive is `make image`'s output (hack/e2e-node.sh and
// hack/demo.sh build it).
func (n *Node) AgentImageArchive() (string, error) {
	p := filepath.Join(n.Env.Root, "bin", "ambientd-image.tar")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("agent image: %w (run `make image` first)", err)
	}
	return p, nil
}

// Tainted reports whether the node carries taint (key and effect).
func (n *Node) Tainted(ctx context.Context, taint corev1.Taint) (bool, error) {
	node, err := n.Env.CP.Admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(node.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == taint.Key && t.Effect == taint.Effect
	}), nil
}

// AgentReadyz returns the agent's /readyz?verbose status code and body.
func AgentReadyz(ctx context.Context) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, AgentHealth+"/readyz?verbose", nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(b), nil
}

// ConflistText returns the node's CNI config file (the primary CNI's; the
// agent may use its own file instead, see RuntimeConfig).
func (n *Node) ConflistText() (string, error) {
	b, err := os.ReadFile(filepath.Join(n.CNIConfDir, Conflist))
	return string(b), err
}

// RuntimeConfig returns the name and text of the CNI config containerd uses
// (cniinstall.RuntimeConfig: the lexically first valid .conf, .conflist or
// .json of the conf dir; the agent's own conflist when it writes one, else
// the primary's).
func (n *Node) RuntimeConfig() (name, text string, err error) {
	rc, err := cniinstall.RuntimeConfig(n.CNIConfDir)
	if err != nil {
		return "", "", err
	}
	return filepath.Base(rc.Path), string(rc.Data), nil
}

// PluginInstalled reports whether the agent's plugin is in the CNI config
// containerd uses.
func (n *Node) PluginInstalled() (bool, error) {
	rc, err := cniinstall.RuntimeConfig(n.CNIConfDir)
	return slices.Contains(rc.Types, cniapi.PluginType), err
}

// AgentPod returns the agent DaemonSet's pod (nil if none yet).
func (n *Node) AgentPod(ctx context.Context) (*corev1.Pod, error) {
	pods, err := n.Env.CP.Admin.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "app=ambientd"})
	if err != nil || len(pods.Items) == 0 {
		return nil, err
	}
	return &pods.Items[0], nil
}

// Poll calls cond every interval until it returns true with no error, or ctx
// ends; the error then names what was awaited and cond's last error.
func Poll(ctx context.Context, what string, interval time.Duration, cond func(ctx context.Context) (bool, error)) error {
	var lastErr error
	err := wait.PollUntilContextCancel(ctx, interval, true, func(ctx context.Context) (bool, error) {
		ok, err := cond(ctx)
		lastErr = err
		return ok && err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("%s: %w (last error: %v)", what, err, lastErr)
	}
	return nil
}

// WaitPod polls the pod until cond holds; on timeout the error names the
// pod's phase and conditions.
func (n *Node) WaitPod(ctx context.Context, ns, name string, cond func(*corev1.Pod) bool) (*corev1.Pod, error) {
	var last *corev1.Pod
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := n.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = p
		return cond(p), nil
	})
	if err != nil {
		return last, fmt.Errorf("pod %s/%s: %w; last seen: %s", ns, name, err, Describe(last))
	}
	return last, nil
}

// PodReady reports whether p is Running with condition Ready=True.
func PodReady(p *corev1.Pod) bool {
	if p == nil || p.Status.Phase != corev1.PodRunning {
		return false
	}
	c := Condition(p, corev1.PodReady)
	return c != nil && c.Status == corev1.ConditionTrue
}

// Condition returns p's condition of type typ (nil if absent).
func Condition(p *corev1.Pod, typ corev1.PodConditionType) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == typ {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// Describe is a one-line summary of p for error messages.
func Describe(p *corev1.Pod) string {
	if p == nil {
		return "never"
	}
	s := fmt.Sprintf("phase %s node %q ip %q", p.Status.Phase, p.Spec.NodeName, p.Status.PodIP)
	for _, c := range p.Status.Conditions {
		s += fmt.Sprintf("; %s=%s %s", c.Type, c.Status, c.Message)
	}
	for _, c := range p.Status.ContainerStatuses {
		if c.State.Waiting != nil {
			s += fmt.Sprintf("; container %s waiting: %s %s", c.Name, c.State.Waiting.Reason, c.State.Waiting.Message)
		}
	}
	return s
}

// GatedPod is a pod of the app image (HTTP readiness probe) with the enrolled
// readiness gate written in it; it does not tolerate the startup taint.
func GatedPod(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       GatedPodSpec(),
	}
}

// GatedPodSpec is GatedPod's spec (for Deployments too).
func GatedPodSpec() corev1.PodSpec {
	spec := AppPodSpec()
	spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: EnrolledCondition}}
	return spec
}

// AppPod is GatedPod without the gate, as users write pods: in an ambient
// namespace deploy/'s admission policy adds the gate.
func AppPod(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       AppPodSpec(),
	}
}

// AppPodSpec is AppPod's spec (for Deployments too).
func AppPodSpec() corev1.PodSpec {
	grace := int64(5)
	return corev1.PodSpec{
		Containers:                    []corev1.Container{AppContainer()},
		TerminationGracePeriodSeconds: &grace,
	}
}

// PodNetns returns the path (in NetnsDir) of the pod network namespace that
// holds ip: what containerd made for the pod's current sandbox.
func (n *Node) PodNetns(ip netip.Addr) (string, error) {
	entries, err := os.ReadDir(n.NetnsDir)
	if err != nil {
		return "", err
	}
	for _, e := range entries {
		p := filepath.Join(n.NetnsDir, e.Name())
		found, err := netnsHolds(p, ip)
		if err == nil && found {
			return p, nil
		}
	}
	return "", fmt.Errorf("no network namespace in %s holds %s", n.NetnsDir, ip)
}

func netnsHolds(path string, ip netip.Addr) (bool, error) {
	h, err := podnetns.Open(path)
	if err != nil {
		return false, err
	}
	defer h.Close()
	found := false
	err = h.Do(func(cnins.NetNS) error {
		addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			if got, ok := netip.AddrFromSlice(a.IP); ok && got.Unmap() == ip {
				found = true
			}
		}
		return nil
	})
	return found, err
}

// DialFrom opens a TCP connection to dst from inside the network namespace
// at netnsPath (the caller closes it).
func DialFrom(ctx context.Context, netnsPath, dst string) (net.Conn, error) {
	h, err := podnetns.Open(netnsPath)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	var c net.Conn
	err = h.Do(func(cnins.NetNS) error {
		c, err = (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", dst)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial %s from %s: %w", dst, netnsPath, err)
	}
	return c, nil
}
