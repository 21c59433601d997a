package agent

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// The sandbox a pod is enrolled in is part of "enrolled": the agent holds
// the pod's netns open, and what it verifies is that namespace. A pod whose
// sandbox the runtime recreated without our plugin (the ADD missed us) runs
// in another namespace, uncaptured, while the old one — kept alive by our
// handle — still reads back perfect rules. So before rules are checked, the
// held namespace must still be the pod's current sandbox (notCurrent).

// notCurrent says why e's held netns is not pod's current sandbox (ips are
// the pod's addresses as the API shows them now), or "" when it is: the
// pod's addresses are among those it was enrolled with (an enrolled pod's
// IPs change only with its sandbox; the runtime may have reported more than
// kubelet shows, one per family; addresses the API still showed when a CNI
// ADD enrolled the pod in a newer sandbox are the old sandbox's, not a sign
// of another), the runtime's path still names the held namespace, and that
// namespace holds one of them. A namespace whose
// addresses cannot be read counts as current (logged): a netlink hiccup
// must not flap every pod.
func (a *Agent) notCurrent(e registry.Entry, ips []netip.Addr) string {
	if e.Netns == nil {
		return "no network namespace held"
	}
	if len(e.LaggingAPIIPs) > 0 && sameIPs(ips, e.LaggingAPIIPs) {
		// The API has not caught up with the sandbox a CNI ADD enrolled
		// the pod in: judge the held one by the addresses it was
		// enrolled with.
		ips = e.IPs
	}
	if len(e.IPs) > 0 && len(ips) > 0 && !subsetIPs(ips, e.IPs) {
		return fmt.Sprintf("the pod's IPs changed from %v to %v: a new sandbox", e.IPs, ips)
	}
	ok, why, err := a.finder.Current(e.Netns, ips)
	if err != nil {
		a.podLog(e.Namespace, e.Name, e.UID).Warn("cannot check that the held netns is the pod's current sandbox; assuming it is", "netns", e.Netns.String(), "error", err)
		return ""
	}
	if !ok {
		return why
	}
	return ""
}

// subsetIPs reports whether every address of sub is in of.
func subsetIPs(sub, of []netip.Addr) bool {
	for _, ip := range sub {
		if !slices.Contains(of, ip) {
			return false
		}
	}
	return true
}

// leaveSandbox takes a pod out of a held netns that is no longer its
// sandbox, in one step: its probe entry goes (its addresses now belong to an
// uncaptured sandbox, or to nobody), the handle and the state record are
// dropped, and the pod is Uncaptured — annotated pending with the condition
// False, published now, before it is enrolled again in its new sandbox (a
// later write in the same sync may replace it before it lands; the pod
// status writer writes the newest). Its ztunnel is not told: the pod's next
// Add, with the new netns, replaces the old proxy (ztunnel compares the
// namespaces).
func (a *Agent) leaveSandbox(ctx context.Context, log *slog.Logger, s *podSync, e registry.Entry, ips []netip.Addr, why string) (registry.Entry, error) {
	if len(e.IPs) > 0 {
		if err := a.rules.RemoveProbeIPs(ctx, e.UID, e.IPs); err != nil {
			a.metrics.failure("probe_ips")
			log.Warn("removing the old sandbox's probe entry failed; the drift pass prunes it", "error", err)
		}
	}
	held := ""
	if e.Netns != nil {
		held = e.Netns.String()
	}
	e, err := a.update(e.UID, func(x *registry.Entry) {
		x.Phase, x.Netns, x.LaggingAPIIPs = registry.Uncaptured, nil, nil
		if len(ips) > 0 {
			x.IPs = ips
		}
		x.LastError, x.Reason = "pod sandbox changed ("+why+"); re-enrolling it in its new sandbox", ReasonSandboxChanged
	})
	if err != nil {
		return e, err
	}
	a.forgetNetns(e.UID)
	a.metrics.repairs.WithLabelValues("sandbox").Inc()
	a.podEvent(e.UID, corev1.EventTypeWarning, EventSandboxChanged, "The pod's sandbox changed ("+why+"): the agent re-enrolls it in its new sandbox; until then it is not captured")
	log.Warn("pod sandbox changed; re-enrolling", "reason", why, "held", held)
	a.publishNow(s, e)
	return e, nil
}

// ensureNetns returns e with a netns handle, finding the pod's current
// sandbox (state file, then a /proc scan, both checked to hold one of e's
// IPs) when the pod has none.
func (a *Agent) ensureNetns(ctx context.Context, e registry.Entry) (registry.Entry, error) {
	if e.Netns != nil {
		return e, nil
	}
	found, _, err := a.findNetns(ctx, []podnetns.Target{{UID: e.UID, RuntimeUID: a.runtimeUIDOf(e.UID), IPs: e.IPs}})
	h := found[e.UID]
	if err == nil && h == nil {
		err = fmt.Errorf("pod %s/%s (IPs %v): %w", e.Namespace, e.Name, e.IPs, podnetns.ErrNotFound)
	}
	if err != nil {
		if h != nil {
			h.Close()
		}
		a.metrics.failure("netns_not_found")
		return e, fmt.Errorf("%w: %w", ErrNetnsUnusable, err)
	}
	a.recordNetns(e.UID, h, e.Options)
	return a.update(e.UID, func(x *registry.Entry) { x.Netns = h })
}

// openNetns opens a netns path a caller (CNI ADD) gave: it must be a network
// namespace (checked before it is opened) and not the node's own.
func (a *Agent) openNetns(path string) (*podnetns.Handle, error) {
	h, err := a.finder.Open(path)
	if err != nil {
		a.metrics.failure("netns")
		return nil, fmt.Errorf("%w: netns %q: %w", ErrNetnsUnusable, path, err)
	}
	if a.finder.IsHost(h) {
		h.Close()
		a.metrics.failure("host_netns")
		return nil, fmt.Errorf("%w: netns %q: %w", ErrNetnsUnusable, path, podnetns.ErrHostNetns)
	}
	return h, nil
}

// findNetns looks the targets' namespaces up: the state file first (the
// namespace its CNI ADD recorded, if still there and still holding one of
// the pod's IPs — inode numbers are reused — and not the node's), then one
// /proc scan for the rest. viaState marks those the state file gave. The
// caller owns the handles.
func (a *Agent) findNetns(ctx context.Context, targets []podnetns.Target) (found map[string]*podnetns.Handle, viaState map[string]bool, err error) {
	found, viaState = map[string]*podnetns.Handle{}, map[string]bool{}
	var rest []podnetns.Target
	for _, t := range targets {
		if a.state != nil {
			if h, ok := a.state.Open(t.UID); ok {
				if aerr := a.finder.Accept(h, t.IPs); aerr == nil {
					found[t.UID], viaState[t.UID] = h, true
					continue
				} else {
					a.log.Info("state file netns not accepted; scanning /proc", "uid", t.UID, "error", aerr)
				}
				h.Close()
			}
		}
		rest = append(rest, t)
	}
	if len(rest) == 0 {
		return found, viaState, nil
	}
	scanned, err := a.finder.Find(ctx, rest)
	maps.Copy(found, scanned)
	return found, viaState, err
}

// recordNetns notes pod uid's namespace and capture options in the state
// file (best effort: the /proc scan remains).
func (a *Agent) recordNetns(uid string, h *podnetns.Handle, opts iptables.PodOptions) {
	if a.state == nil || h == nil {
		return
	}
	if err := a.state.Put(uid, h, opts); err != nil {
		a.log.Warn("recording pod netns in the state file", "uid", uid, "error", err)
	}
}

// forgetNetns drops pod uid from the state file.
func (a *Agent) forgetNetns(uid string) {
	if a.state == nil {
		return
	}
	if err := a.state.Delete(uid); err != nil {
		a.log.Warn("removing pod netns from the state file", "uid", uid, "error", err)
	}
}
