package iptables

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/ambientd/ambientd/iptables/internal/ipset"
	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/iptables/internal/xtables"
)

// Successor names the node agent that takes a node over when ambientd
// leaves it (`ambientd run --handover`). The outgoing agent moves every
// enrolled pod's rules into the backend that agent will program pods with
// (SuccessorMode), so the incoming agent finds them as its own: its start-up
// reconcile sees its rules in place, and when it later takes a pod out of
// the mesh it deletes the only capture rules the pod has.
//
// Istio's agent looks only at its own backend: in iptables mode at its
// chains in the one iptables variant it detected at start, in native
// nftables mode at its inet tables. Rules it does not look at would stay in
// the pod after it removed its own — redirecting to a ztunnel that no
// longer serves the pod.
type Successor string

const (
	// SuccessorNone: nothing is moved; the pods keep their rules in our
	// backend (an upgrade, a restart, or ambientd again later).
	SuccessorNone Successor = "none"
	// SuccessorIstio is Istio's istio-cni agent with its chart defaults:
	// iptables, the variant chosen at its start (see SuccessorMode).
	SuccessorIstio Successor = "istio"
	// SuccessorIstioNFTables is Istio's agent in native nftables mode
	// (chart value global.nativeNftables=true; Istio 1.28+).
	SuccessorIstioNFTables Successor = "istio-nftables"
)

// ParseSuccessor accepts "" and "none", "istio", "istio-nftables", or a
// backend — "legacy", "nft", "nftables" — for an agent pinned to it (Istio's
// FORCE_IPTABLES_BINARY=legacy|nft, or ambientd's --iptables).
func ParseSuccessor(s string) (Successor, error) {
	switch Successor(s) {
	case "", SuccessorNone:
		return SuccessorNone, nil
	case SuccessorIstio, SuccessorIstioNFTables:
		return Successor(s), nil
	}
	if m, err := ParseMode(s); err == nil && m != ModeAuto {
		return Successor(s), nil
	}
	return "", fmt.Errorf("handover %q: want none, istio, istio-nftables, legacy, nft or nftables", s)
}

// SuccessorMode returns the backend successor will program pods with when
// it starts on this node, read in the calling thread's network namespace,
// which must be the node's. Call it once our own host rules and probe sets
// are gone: Istio's agent reads the node as it finds it then.
//
// Istio's agent (release-1.31, cni/pkg/nodeagent/server_linux.go and
// tools/istio-iptables/pkg/dependencies) decides once, at start, in the
// node's network namespace:
//
//   - native nftables mode: nftables, unless a probe ipset of the iptables
//     mode exists (istio-inpod-probes-v4, or -v6 with IPv6): then iptables
//     "until the node reboots". (Also iptables when its nft binary lacks
//     JSON support; ambientd cannot see Istio's image and assumes it has.)
//   - iptables, per address family: iptables-legacy when
//     `iptables-legacy-save` prints any table — any legacy table in the node's
//     namespace, even an empty one — else iptables-nft.
//
// Its detection probe adds and deletes a rule in the legacy nat table of
// both families, leaving that table behind: from its second start on, Istio
// picks legacy wherever the kernel has legacy support. So the families can
// differ only on a node where something created a legacy table of one
// family and not the other. ambientd programs both families in one
// backend, so there it creates the other family's empty legacy nat table —
// exactly what Istio's probe leaves — and hands over to legacy; Istio's
// agent then picks legacy for both.
func SuccessorMode(ctx context.Context, s Successor, ipv6 bool, log *slog.Logger) (Mode, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	fams := rules.Families(ipv6)
	switch s {
	case SuccessorIstioNFTables:
		sets, err := ipset.Exist(fams)
		if err != nil {
			return "", fmt.Errorf("reading the node's probe ipsets: %w", err)
		}
		if !sets {
			return ModeNFTables, nil
		}
		log.Warn("probe ipsets of the iptables mode exist on the node: Istio's agent in native nftables mode will use iptables", "sets", fmt.Sprint(fams))
		return istioIPTablesMode(ctx, fams, log)
	case SuccessorIstio:
		return istioIPTablesMode(ctx, fams, log)
	case SuccessorNone, "":
		return "", fmt.Errorf("no successor: nothing to hand over")
	}
	return ParseMode(string(s))
}

// istioIPTablesMode is the iptables variant Istio's agent detects, per
// family, made one for both (see SuccessorMode).
func istioIPTablesMode(ctx context.Context, fams []Family, log *slog.Logger) (Mode, error) {
	choice := map[Family]Mode{}
	var legacyFams, nftFams []Family
	for _, f := range fams {
		_, legacyErr := xtables.LookTools(f, ModeLegacy)
		_, nftErr := xtables.LookTools(f, ModeNFT)
		used, err := xtables.LegacyTablesUsed(f)
		if err != nil {
			return "", err
		}
		switch {
		case legacyErr == nil && used:
			choice[f] = ModeLegacy
			legacyFams = append(legacyFams, f)
		case nftErr == nil:
			choice[f] = ModeNFT
			nftFams = append(nftFams, f)
		case legacyErr == nil:
			choice[f] = ModeLegacy
			legacyFams = append(legacyFams, f)
		default:
			return "", fmt.Errorf("no iptables tools for %s: %v; %v", f, legacyErr, nftErr)
		}
	}
	if len(nftFams) == 0 || len(legacyFams) == 0 {
		mode := choice[fams[0]]
		log.Info("Istio's agent will use this iptables variant", "mode", string(mode), "legacy_tables", len(legacyFams) > 0)
		return mode, nil
	}
	// Split: some families have legacy tables, others not.
	b, err := xtables.New(xtables.Config{Node: rules.Node{IPv6: len(fams) > 1}}, log, ModeLegacy, false)
	if err != nil {
		return "", err
	}
	for _, f := range nftFams {
		if err := b.EnsureLegacyTable(ctx, f, "nat"); err != nil {
			return "", err
		}
		if used, err := xtables.LegacyTablesUsed(f); err != nil || !used {
			return "", fmt.Errorf("created the legacy %s nat table, but the kernel lists no legacy %s table (%v)", f, f, err)
		}
	}
	log.Info("legacy iptables tables existed for some address families only; created the others' empty nat table, as Istio's own start-up probe does, so Istio's agent uses iptables-legacy for all",
		"had_legacy", fmt.Sprint(legacyFams), "created", fmt.Sprint(nftFams))
	return ModeLegacy, nil
}
