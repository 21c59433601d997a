// Package nodeenv is a real single Kubernetes node for end-to-end tests: on
// top of test/infra/e2eenv's control plane (etcd + kube-apiserver) it runs
// containerd and runc (Debian packages), kubelet, kube-controller-manager and
// kube-scheduler (built from k8s.io/kubernetes by hack/ensure, test/infra/build).
// Pods get their network from containerd's CRI calling the CNI chain in the
// node's own conf dir (reference bridge + host-local + loopback plugins), and
// images come from Go (go-containerregistry) imported with ctr: no registry,
// pods use imagePullPolicy: Never.
//
// Everything runs inside e2eenv's throwaway node network namespace and its
// private mount namespace. In that mount namespace the environment mounts the
// machine's cgroup hierarchies again under /sys/fs/cgroup (`ip netns exec`
// remounted /sys), and tmpfs over the paths containerd and kubelet hard-code
// (/run/containerd for shim sockets, /var/lib/cni for libcni's cache,
// /var/log for kubelet's container log links), so nothing of the node is
// written to the machine's own files. What is shared with the machine, and
// cleaned up by the outer process even when the inner one crashed:
//   - cgroups: kubelet's cgroup root /<CgroupPrefix><id> in every hierarchy;
//   - sysctls kubelet sets (vm.overcommit_memory, kernel.panic,
//     kernel.panic_on_oops, ...), saved before and restored after the run;
//   - empty mount-point directories for the tmpfs mounts, removed afterwards
//     when the run created them.
//
// Typical use, in a test package built with the e2enode tag:
//
//	var node *nodeenv.Node
//
//	func TestMain(m *testing.M) {
//		nodeenv.Main(m, nodeenv.Options{}, func(n *nodeenv.Node) { node = n })
//	}
package nodeenv
