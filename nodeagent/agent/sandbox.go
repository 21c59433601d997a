package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podmeta"
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
// kubelet shows, one per family), the runtime's path still names the held
// namespace, and that namespace holds one of them. A namespace whose
// addresses cannot be read counts as current (logged): a netlink hiccup
// must not flap every pod.
func (a *Agent) notCurrent(e registry.Entry, ips []netip.Addr) string {
	if e.Netns == nil {
		return "no network namespace held"
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
		x.Phase, x.Netns = registry.Uncaptured, nil
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
	log.Warn("pod sandbox changed; re-enrolling", "why", why, "held", held)
	a.publishNow(s, e)
	return e, nil
}

// publishNow writes the status of e's phase at once, in the middle of a sync
// (which publishes again at its end if the phase moves on).
func (a *Agent) publishNow(s *podSync, e registry.Entry) {
	if s == nil || s.pod == nil || !a.takeMoved(e.UID) {
		return
	}
	a.publish(*s, e, true, nil)
}

// ensureNetns returns e with a netns handle, finding the pod's current
// sandbox (state file, then a /proc scan, both checked to hold one of e's
// IPs) when the pod has none.
func (a *Agent) ensureNetns(ctx context.Context, e registry.Entry) (registry.Entry, error) {
	if e.Netns != nil {
		return e, nil
	}
	found, _, err := a.findNetns(ctx, []podnetns.Target{{UID: e.UID, IPs: e.IPs}})
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
	h, err := podnetns.Open(path)
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

// The rule calls go through these, which refuse the node's own netns: pod
// rules are never written, read as a pod's or deleted there (with the
// nftables backend, deleting "a pod's" tables in the node's netns would
// delete the host's probe SNAT of every pod).
func (a *Agent) hostGuard(h *podnetns.Handle, what string) error {
	if h == nil {
		return fmt.Errorf("%s: no netns", what)
	}
	if a.finder.IsHost(h) {
		a.metrics.failure("host_netns")
		return fmt.Errorf("%s in netns %s: %w", what, h, podnetns.ErrHostNetns)
	}
	return nil
}

func (a *Agent) deleteRules(ctx context.Context, h *podnetns.Handle) error {
	if err := a.hostGuard(h, "delete pod rules"); err != nil {
		return err
	}
	return a.rules.DeletePod(ctx, h)
}

func (a *Agent) verifyRules(ctx context.Context, h *podnetns.Handle, opts iptables.PodOptions) (iptables.Drift, error) {
	if err := a.hostGuard(h, "verify pod rules"); err != nil {
		return iptables.Drift{}, err
	}
	return a.rules.VerifyPod(ctx, h, opts)
}

// handoverSet holds the pods a closed ztunnel connection held, to be Added
// to the newest one by their next sync, with the server's report callbacks.
type handoverSet struct {
	mu sync.Mutex
	m  map[string][]func(error)
}

// HandOver implements ztunnel.HandoverSink: the pod's next sync (queued
// here, run under the pod's lock) sends the Add, so an Add can never land
// after a release's Del. report, if not nil, is told the Add's result.
func (a *Agent) HandOver(uid string, report func(error)) {
	a.handovers.mu.Lock()
	if a.handovers.m == nil {
		a.handovers.m = map[string][]func(error){}
	}
	a.handovers.m[uid] = append(a.handovers.m[uid], report)
	a.handovers.mu.Unlock()
	a.queue.Add(uid)
}

// take reports whether uid is waiting to be handed over (its reports stay
// until done).
func (h *handoverSet) take(uid string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, ok := h.m[uid]
	return ok
}

// drop forgets uid's handover without reporting (the pod was released).
func (h *handoverSet) drop(uid string) {
	h.mu.Lock()
	delete(h.m, uid)
	h.mu.Unlock()
}

// done returns the function that reports an Add of uid to whoever asked
// for a handover, and forgets them.
func (h *handoverSet) done(uid string) func(error) {
	h.mu.Lock()
	reports := h.m[uid]
	delete(h.m, uid)
	h.mu.Unlock()
	return func(err error) {
		for _, r := range reports {
			if r != nil {
				r(err)
			}
		}
	}
}

// invalidSeen remembers, per pod, the invalid annotation values an Event
// was recorded for, so a pod synced again and again is told once.
type invalidSeen struct {
	mu sync.Mutex
	m  map[string]string
}

func (s *invalidSeen) changed(uid, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]string{}
	}
	if s.m[uid] == key {
		return false
	}
	if key == "" {
		delete(s.m, uid)
	} else {
		s.m[uid] = key
	}
	return true
}

func (s *invalidSeen) forget(uid string) { s.changed(uid, "") }

// noteInvalid records a Warning Event for the pod's invalid annotation
// values (once per distinct set), saying what the agent does instead.
func (a *Agent) noteInvalid(pod *corev1.Pod, enrolled bool, invalid []*podmeta.InvalidAnnotationError) {
	var keys []string
	for _, e := range invalid {
		keys = append(keys, e.Annotation+"="+e.Value)
	}
	sort.Strings(keys)
	if !a.invalid.changed(string(pod.UID), strings.Join(keys, "\x00")) || len(invalid) == 0 {
		return
	}
	for _, e := range invalid {
		a.metrics.failure("bad_annotation")
		var does string
		switch {
		case enrolled:
			does = "ignored: the pod keeps the value it was enrolled with, and is verified against it"
		case e.OnInvalid == podmeta.RefuseNew:
			does = "the pod is not enrolled (its CNI ADD fails) until the value is fixed"
		default:
			does = "ignored (as Istio does): the node's default applies"
		}
		a.recorder.Event(refOf(pod.Namespace, pod.Name, string(pod.UID)), corev1.EventTypeWarning, EventInvalidAnnotation, e.Error()+"; "+does)
	}
}
