// Package e2eenv is the end-to-end test environment of ambientd: a real
// kube-apiserver and etcd on loopback, the real CNI chain (reference
// loopback/bridge/host-local plugins plus, optionally, bin/ambientd-cni)
// driven through libcni, and helpers that play the kubelet's part (create pods
// with spec.nodeName, run the chain, patch pods/status with the assigned IPs),
// run the agent and the ztunnel emulator as subprocesses and dial from inside
// a pod's network namespace.
//
// The scheduler's, kubelet's and container runtime's part (CreatePod,
// RecreateSandbox, DeletePod) is a double. Follows: kubelet 1.37 with
// containerd 1.6's CRI calling CNI, as seen on the real node
// (test/infra/nodeenv; docs/realnode.md): the Pod bound to the node, a
// netns and a pause process in the pod's cgroup per sandbox, CNI ADD with
// K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_INFRA_CONTAINER_ID and
// K8S_POD_UID in CNI_ARGS, then pods/status Running and Ready with the
// assigned IPs; on delete CNI DEL, then the sandbox, netns and Pod object
// removed. Does not emulate: containers (no images, no app process, no
// probes, no restarts: Ready is written, not earned), the CRI itself, and
// the runtime's own retries (a failed ADD retried, a DEL repeated with an
// empty CNI_NETNS) but where a test does them; the real-node suite
// (make e2e-node) has those from the real kubelet and containerd.
//
// Everything runs inside one throwaway "node" network namespace: Main (and
// RunIsolated) re-executes the current program under `ip netns exec` in a
// fresh namespace with only lo, so etcd, the apiserver, the agent, the bridge
// and the pod veths never touch the machine's real network, and cleanup is
// killing what is left in that namespace and deleting it. Pod network
// namespaces are bind-mounted inside the private mount namespace that
// `ip netns exec` creates, under the environment's work directory.
//
// Typical use, in a test package built with the e2e tag:
//
//	var testEnv *e2eenv.Env
//
//	func TestMain(m *testing.M) {
//		e2eenv.Main(m, e2eenv.Options{}, func(e *e2eenv.Env) { testEnv = e })
//	}
package e2eenv
