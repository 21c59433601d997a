package iptables

import (
	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// Sidecar mode (docs/sidecar.md): the vocabulary and rule sets of the
// sidecar rules, re-exported so callers need only this package.

const (
	SidecarTProxyMark  = rules.SidecarTProxyMark
	SidecarTProxyTable = rules.SidecarTProxyTable
	DefaultProxyID     = rules.DefaultProxyID

	InterceptRedirect = rules.InterceptRedirect
	InterceptTProxy   = rules.InterceptTProxy

	// The sidecar chains of the iptables backends and tables of the
	// nftables backend (Istio's names).
	ChainSidecarRedirect  = xtables.ChainSidecarRedirect
	NFTTableSidecarNat    = nftables.TableSidecarNat
	NFTTableSidecarMangle = nftables.TableSidecarMangle
	NFTTableSidecarRaw    = nftables.TableSidecarRaw
)

type (
	// SidecarOptions is what a pod's sidecar rules depend on.
	SidecarOptions = rules.SidecarOptions
	// InterceptMode is REDIRECT or TPROXY.
	InterceptMode = rules.InterceptMode
	// SidecarRuleSet is the iptables backends' sidecar rules (per family,
	// ours in our chains and in the built-in ones, in kernel order).
	SidecarRuleSet = xtables.SidecarRuleSet
	SidecarFamily  = xtables.SidecarFamily
)

// BuildSidecarRules returns a pod's sidecar rules for the iptables
// backends, in the text iptables-save prints. It touches nothing.
func BuildSidecarRules(o SidecarOptions) SidecarRuleSet { return xtables.BuildSidecarRules(o) }

// BuildSidecarRulesNFT returns a pod's sidecar rules for the nftables
// backend, in Istio's istio-proxy-* layout.
func BuildSidecarRulesNFT(o SidecarOptions) NFTRuleSet { return nftables.BuildSidecarRules(o) }
