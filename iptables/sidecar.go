package iptables

import (
	"context"
	"errors"
	"fmt"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Sidecar mode (docs/sidecar.md): the rules Istio's istio-cni programs for
// a pod with an injected istio-proxy, with the Manager's backend. A pod has
// the ambient rules or the sidecar rules, never both: the agent's policy
// decides which.

func (m *Manager) sidecarBackend(b rules.Backend) (rules.SidecarBackend, error) {
	sb, ok := b.(rules.SidecarBackend)
	if !ok {
		return nil, fmt.Errorf("rule backend %s has no sidecar mode", b.Mode())
	}
	return sb, nil
}

// othersHoldingSidecar returns the other backends holding sidecar rules in
// the current namespace.
func (m *Manager) othersHoldingSidecar(ctx context.Context, v rules.View) ([]rules.SidecarBackend, error) {
	var out []rules.SidecarBackend
	for _, o := range m.others {
		sb, ok := o.(rules.SidecarBackend)
		if !ok {
			continue
		}
		held, err := sb.HoldsSidecar(ctx, v)
		if err != nil {
			return out, fmt.Errorf("reading %s sidecar rules: %w", o.Mode(), err)
		}
		if held {
			out = append(out, sb)
		}
	}
	return out, nil
}

// ApplySidecar programs the pod's sidecar rules (and, for IPv6 or TPROXY,
// its ::6 address and policy route) inside podNS. Idempotent: a pod that
// already has exactly these rules is not written to; one with other or
// partial rules of ours converges (old, when known, are the options it was
// programmed with). Sidecar rules found in another backend (Istio's agent
// in another mode) are removed once ours are in place.
func (m *Manager) ApplySidecar(ctx context.Context, podNS ns.NetNS, o SidecarOptions, old *SidecarOptions) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return fmt.Errorf("apply sidecar rules: %w", err)
	}
	sb, err := m.sidecarBackend(m.be)
	if err != nil {
		return err
	}
	return inNS(podNS, "apply sidecar rules", func() error {
		if err := ensureSidecarNet(o); err != nil {
			return err
		}
		v, done := m.view()
		defer done()
		if err := sb.ApplySidecar(ctx, o, old, v); err != nil {
			return err
		}
		holding, err := m.othersHoldingSidecar(ctx, v)
		for _, other := range holding {
			m.log.Info("removing sidecar rules of another backend from the pod", "netns", podNS.Path())
			if err := other.DeleteSidecar(ctx, &o, v); err != nil {
				return fmt.Errorf("removing sidecar rules of another backend: %w", err)
			}
		}
		return err
	})
}

// VerifySidecar reports how the pod's sidecar rules and netlink state
// differ from what ApplySidecar would install, including sidecar rules left
// in another backend. It changes nothing.
func (m *Manager) VerifySidecar(ctx context.Context, podNS ns.NetNS, o SidecarOptions) (Drift, error) {
	if err := ctx.Err(); err != nil {
		return Drift{}, err
	}
	if err := o.Validate(); err != nil {
		return Drift{}, fmt.Errorf("verify sidecar rules: %w", err)
	}
	sb, err := m.sidecarBackend(m.be)
	if err != nil {
		return Drift{}, err
	}
	var d Drift
	err = inNS(podNS, "verify sidecar rules", func() error {
		nd, err := verifySidecarNet(o)
		if err != nil {
			return err
		}
		d.Add(nd)
		v, done := m.view()
		defer done()
		bd, err := sb.VerifySidecar(ctx, o, v)
		d.Add(bd)
		if err != nil {
			return err
		}
		holding, err := m.othersHoldingSidecar(ctx, v)
		for range holding {
			d.Unexpected = append(d.Unexpected, "sidecar rules present in another rule backend too")
		}
		return err
	})
	return d, err
}

// DeleteSidecar removes the pod's sidecar rules from every backend holding
// them, and the TPROXY policy route (o, when known, names the rules the pod
// had in built-in chains). Nothing left is success.
func (m *Manager) DeleteSidecar(ctx context.Context, podNS ns.NetNS, o *SidecarOptions) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sb, err := m.sidecarBackend(m.be)
	if err != nil {
		return err
	}
	return inNS(podNS, "delete sidecar rules", func() error {
		v, done := m.view()
		defer done()
		errs := []error{sb.DeleteSidecar(ctx, o, v)}
		holding, err := m.othersHoldingSidecar(ctx, v)
		errs = append(errs, err)
		for _, other := range holding {
			errs = append(errs, other.DeleteSidecar(ctx, o, v))
		}
		return errors.Join(append(errs, deleteSidecarNet())...)
	})
}
