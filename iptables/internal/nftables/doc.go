// Package nftables is the native-nftables technology of ambientd's rules:
// the in-pod and host rule sets in Istio's istio-ambient-* inet layout as
// data (statements whose nft text and netlink expressions come from one
// constructor, so the golden text and what is programmed cannot drift
// apart), applied, read back, compared and deleted over netlink with one
// atomic transaction per operation and no process spawned; the probe sets
// as nftables sets; the kubelet-uid discovery Istio's nft host rule keys on;
// the kernel-support check; and the View of a namespace's nftables chains
// that the backends of one operation share.
//
// It may import only the bottom layer, iptables/internal/rules, of ambientd:
// never a sibling technology package (xtables, ipset), never package
// iptables, never Kubernetes.
package nftables
