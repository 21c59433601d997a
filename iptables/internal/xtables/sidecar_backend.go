package xtables

import (
	"context"
	"fmt"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// sidecarChainNames are the chain names only the sidecar rules use: a
// namespace holding one holds sidecar rules.
var sidecarChainNames = []string{ChainSidecarInbound, ChainSidecarRedirect, ChainSidecarInRedirect, ChainSidecarOutputDNS, ChainSidecarDivert, ChainSidecarTProxy}

// sidecarFamilies returns the families the pod's rules cover, checking the
// tools are there.
func (b *Backend) sidecarFamilies(o rules.SidecarOptions) ([]rules.Family, error) {
	fams := o.Families()
	for _, f := range fams {
		if _, ok := b.tools[f]; !ok {
			return nil, fmt.Errorf("sidecar rules for %s: no %s %s tools", f, f, b.mode)
		}
	}
	return fams, nil
}

// ApplySidecar makes the namespace's sidecar rules exactly o's: on a fresh
// pod one restore per family (the batch creates our chains with -N); else
// one save per family and, where it differs, one restore that converges
// (old, when known, are the options the pod had: their rules in built-in
// chains are removed too).
func (b *Backend) ApplySidecar(ctx context.Context, o rules.SidecarOptions, old *rules.SidecarOptions, _ rules.View) error {
	fams, err := b.sidecarFamilies(o)
	if err != nil {
		return err
	}
	rs := BuildSidecarRules(o)
	var prev SidecarRuleSet
	if old != nil {
		prev = BuildSidecarRules(*old)
	}
	return b.converge(ctx, "apply sidecar rules", fams, rs.RenderApply, func(f rules.Family, st saveState) string {
		return rs.Family(f).renderConverge(f, st, prev.Family(f))
	})
}

// VerifySidecar reports how the namespace's sidecar rules differ from o's
// (one save per family).
func (b *Backend) VerifySidecar(ctx context.Context, o rules.SidecarOptions, _ rules.View) (rules.Drift, error) {
	fams, err := b.sidecarFamilies(o)
	if err != nil {
		return rules.Drift{}, err
	}
	rs := BuildSidecarRules(o)
	states, err := b.saveAll(ctx, fams)
	if err != nil {
		return rules.Drift{}, err
	}
	var d rules.Drift
	for _, f := range fams {
		d.Add(rs.Family(f).diff(f, states[f]))
	}
	return d, nil
}

// DeleteSidecar removes every sidecar chain and jump into one, and the
// rules o (when known) put into built-in chains, from every family it has
// tools for: one save per family, and one restore where anything is left.
func (b *Backend) DeleteSidecar(ctx context.Context, o *rules.SidecarOptions, _ rules.View) error {
	var fams []rules.Family
	for _, f := range []rules.Family{rules.IPv4, rules.IPv6} {
		if _, ok := b.tools[f]; ok {
			fams = append(fams, f)
		}
	}
	var prev SidecarRuleSet
	if o != nil {
		prev = BuildSidecarRules(*o)
	}
	states, err := b.saveAll(ctx, fams)
	if err != nil {
		return err
	}
	var procs []proc
	var todo []rules.Family
	for _, f := range fams {
		var empty *SidecarFamily
		if batch := empty.renderConverge(f, states[f], prev.Family(f)); batch != "" {
			procs = append(procs, b.restoreProc(f, batch))
			todo = append(todo, f)
		}
	}
	_, errs := b.runAll(ctx, procs)
	for i, err := range errs {
		if err != nil {
			return fmt.Errorf("delete sidecar rules %s: %w", todo[i], err)
		}
	}
	return nil
}

// HoldsSidecar reports whether a sidecar chain exists in this variant.
func (b *Backend) HoldsSidecar(ctx context.Context, v rules.View) (bool, error) {
	return b.holds(ctx, v, sidecarChainNames...)
}
