//go:build e2enode

// Package e2eswitch switches a live real node (test/infra/nodeenv: kubelet,
// containerd, runc) between Istio's own node agent — install-cni and the
// istio-cni plugin, built from test/istio-oracle's pinned Istio, deployed from
// the Cni component Istio's renderer produced — and ambientd's DaemonSet, both
// ways, while pods run, with the ztunnel emulator serving both agents on the
// node's ztunnel socket. Run with `make e2e-switch` (hack/e2e-switch.sh: it
// builds Istio's agent image first); docs/realnode.md, "Switching".
package e2eswitch

import (
	"testing"

	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// node is shared by the package's tests; TestMain brings it up once.
var node *nodeenv.Node

// The node registers without the startup taint: Istio's agent never removes
// it (istiod does, in a cluster), and the scenarios are not about readiness.
// It gets a PID namespace of its own: Istio's agent reads the host's network
// namespace through /host/proc/1 (nodeenv's pidns.go).
func TestMain(m *testing.M) {
	nodeenv.Main(m, nodeenv.Options{PIDNamespace: true}, func(n *nodeenv.Node) { node = n })
}

// logsOnFailure prints the node's component logs when t failed.
func logsOnFailure(t *testing.T) {
	t.Helper()
	for _, p := range []interface{ LogOnFailure(testing.TB) }{node.Kubelet, node.Containerd, node.ControllerManager, node.Scheduler} {
		p.LogOnFailure(t)
	}
}
