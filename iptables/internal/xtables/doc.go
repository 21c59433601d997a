// Package xtables is the iptables-restore technology of ambientd's rules:
// the in-pod and host rule sets as iptables text (Istio's ISTIO_* chains),
// rendered to iptables-restore --noflush batches, applied with one process
// per address family of either variant of the iptables tools (legacy or
// nft), read back with iptables-save, parsed, diffed and repaired.
//
// It owns the rule text, the save parser and the process budget. The probe
// ipsets its host rule matches belong to package ipset, composed with this
// one by package iptables. It may import only the bottom layer,
// iptables/internal/rules, of ambientd: never a sibling technology package
// (nftables, ipset), never package iptables, never Kubernetes.
package xtables
