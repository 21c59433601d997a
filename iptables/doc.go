// Package iptables is the API package of ambientd's rule code: the Manager the
// agent uses to program, verify and delete the in-pod redirection rules of
// an ambient-mesh pod (or, in sidecar mode, Istio's sidecar rules of a pod
// with an injected istio-proxy: ApplySidecar, VerifySidecar, DeleteSidecar)
// and the node's probe SNAT rules, whichever technology carries them. It
// owns the backend choice (auto detection, persisted so it is sticky across
// restarts), the composition of the technology packages
// into backends, the pod's policy route, and the probe-set bookkeeping; it
// re-exports the shared vocabulary and the rule sets as data (BuildPodRules,
// BuildHostRules, BuildPodRulesNFT, BuildHostRulesNFT) callers spell, so
// they need no other import (and can have none: the packages below are
// internal/).
//
// The rule code has three layers, and imports point down only:
//
//	iptables                    (this package) Manager, backend choice and state, policy route
//	iptables/internal/xtables   iptables-restore text, save parsing, host rules   \
//	iptables/internal/nftables  nftables over netlink, Istio's istio-ambient-*    | technologies:
//	iptables/internal/ipset     the iptables backends' probe ipsets               / never each other
//	iptables/internal/rules     families, marks, ports, options, Drift, interfaces
//
// Chain, set, mark and address values are the ones Istio's node agent uses,
// so pods and nodes it set up are recognised and can be adopted. Nothing
// here imports Kubernetes or anything of ambientd outside iptables/.
package iptables
