package nodeenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os/exec"
	"strings"
)

// KubernetesServiceIP is the cluster IP of the `kubernetes` Service in
// default (the first address of e2eenv's --service-cluster-ip-range
// 10.96.0.0/16): what kubelet gives every pod as KUBERNETES_SERVICE_HOST,
// with KUBERNETES_SERVICE_PORT 443.
const KubernetesServiceIP = "10.96.0.1"

// The node runs no kube-proxy, so no Service's cluster IP leads anywhere.
// Two things a cluster's components need of Services are provided by
// other means, both real kube-apiserver and iptables behaviour:
//
//   - pods that use the in-cluster config (not hostNetwork: e.g. the
//     chart's readiness-gate webhook) reach the apiserver at
//     KubernetesServiceIP:443, as kube-proxy's DNAT makes it on a node: one
//     DNAT rule in the node netns to the apiserver, which listens on every
//     address of the node netns and whose certificate names that IP;
//   - the apiserver calls admission webhooks at their Service's endpoints
//     (--enable-aggregator-routing), not at its cluster IP: the pods'
//     addresses are routed in the node netns (the bridge).
func apiServerArgs() []string {
	return []string{"--bind-address=0.0.0.0", "--enable-aggregator-routing=true"}
}

func apiServerServingIPs(nodeIP string) []net.IP {
	return []net.IP{net.ParseIP(KubernetesServiceIP), net.ParseIP(nodeIP)}
}

// proxyKubernetesService adds the DNAT from KubernetesServiceIP:443 to the
// apiserver's port on the node address (again after PowerOff flushed the
// firewall, as kube-proxy does when the node is back).
func (n *Node) proxyKubernetesService(ctx context.Context) error {
	u, err := url.Parse(n.Env.CP.URL)
	if err != nil {
		return fmt.Errorf("the apiserver's URL: %w", err)
	}
	args := []string{"-w", "5", "-t", "nat", "-A", "PREROUTING", "-d", KubernetesServiceIP + "/32", "-p", "tcp", "--dport", "443",
		"-m", "comment", "--comment", "nodeenv: the kubernetes Service (no kube-proxy here)",
		"-j", "DNAT", "--to-destination", net.JoinHostPort(n.IP.String(), u.Port())}
	if out, err := exec.CommandContext(ctx, "iptables", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("the kubernetes Service's DNAT: iptables %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
