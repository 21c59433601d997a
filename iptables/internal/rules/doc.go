// Package rules is the bottom layer of ambientd's rule code: the vocabulary
// every rule backend shares. It owns the address families, the backend
// names, Istio's marks, ports, policy-route numbers, probe SNAT addresses and
// probe-set names, the node's and the pod's rule options, Drift (how live
// rules differ from wanted ones) and its multiset diff, and the interfaces a
// backend, a probe-set store and a namespace's nftables view implement.
//
// It owns no technology and does no I/O. It must not import anything of
// ambientd, Kubernetes, netlink or iptables libraries: the technology
// packages (iptables/internal/xtables, iptables/internal/nftables, iptables/internal/ipset) import it
// and nothing else of ours, and package iptables composes them.
package rules
