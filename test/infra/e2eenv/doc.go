// Package e2eenv is the end-to-end test environment of ambientd: a real
// kube-apiserver and etcd on loopback, the real CNI chain (reference
// loopback/bridge/host-local plugins plus, optionally, bin/ambientd-cni)
// driven through libcni, and helpers that play the kubelet's part (create pods
// with spec.nodeName, run the chain, patch pods/status with the assigned IPs),
// run the agent and the ztunnel emulator as subprocesses and dial from inside
// a pod's network namespace.
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
