package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/policy"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// podLog returns the agent's logger with the pod's identity on every line.
func (a *Agent) podLog(namespace, name, uid string) *slog.Logger {
	return a.log.With("namespace", namespace, "pod", name, "uid", uid)
}

// podByUID returns the cached pod with uid, or nil.
func (a *Agent) podByUID(uid string) *corev1.Pod {
	objs, err := a.podInformer.GetIndexer().ByIndex(uidIndex, uid)
	if err != nil || len(objs) == 0 {
		return nil
	}
	p, _ := objs[0].(*corev1.Pod)
	return p
}

// podByName returns the cached pod namespace/name, or nil.
func (a *Agent) podByName(namespace, name string) *corev1.Pod {
	obj, ok, err := a.podInformer.GetIndexer().GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	p, _ := obj.(*corev1.Pod)
	return p
}

func (a *Agent) namespaceLabels(ctx context.Context, name string) (map[string]string, error) {
	if n, err := a.nsLister.Get(name); err == nil {
		return n.Labels, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := a.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get namespace %s: %w", name, err)
	}
	return n.Labels, nil
}

// decide applies the enrollment policy to pod.
func (a *Agent) decide(ctx context.Context, pod *corev1.Pod) (policy.Decision, error) {
	labels, err := a.namespaceLabels(ctx, pod.Namespace)
	if err != nil && !apierrors.IsNotFound(errors.Unwrap(err)) {
		return policy.Decision{}, err
	}
	return a.cfg.Policy.Decide(pod, labels), nil
}

// reconcile drives one pod (by uid) to its wanted state. It is idempotent and
// safe to run any number of times; an error requeues the pod with backoff.
func (a *Agent) reconcile(ctx context.Context, uid string) error {
	unlock := a.locks.lock(uid)
	defer unlock()

	pod := a.podByUID(uid)
	entry, registered := a.reg.Get(uid)
	if pod == nil {
		if !registered {
			return nil
		}
		// The cache says the pod is gone; make sure before dropping it
		// (a CNI ADD may have enrolled a pod the cache has not seen yet).
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		p, err := a.client.CoreV1().Pods(entry.Namespace).Get(cctx, entry.Name, metav1.GetOptions{})
		cancel()
		switch {
		case err == nil && string(p.UID) == uid:
			pod = p
		case err == nil || apierrors.IsNotFound(err):
			return a.forget(ctx, entry, "deleted")
		default:
			a.metrics.failure("api")
			return fmt.Errorf("check pod %s/%s: %w", entry.Namespace, entry.Name, err)
		}
	}
	log := a.podLog(pod.Namespace, pod.Name, uid)

	d, err := a.decide(ctx, pod)
	if err != nil {
		a.metrics.failure("api")
		return err
	}
	if registered && entry.Releasing {
		// A release that did not finish (its Del or probe step failed).
		// The pod's rules are gone (or the pod is), so finish it; a pod
		// that belongs in the mesh again is then enrolled afresh below.
		if err := a.release(ctx, log, entry, string(d.Reason)); err != nil {
			return err
		}
		registered = false
	}
	if !d.InMesh {
		if registered {
			log.Info("pod left the mesh", "reason", d.Reason)
			return a.removeFromMesh(ctx, pod, entry, d.Reason)
		}
		if _, ok := pod.Annotations[policy.AnnotationRedirection]; ok && pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
			a.status.Set(pod.Namespace, pod.Name, uid, "")
		}
		return nil
	}

	if registered {
		if entry.RulesUnverified {
			return a.verifyRestored(ctx, log, pod, entry)
		}
		if entry.State == registry.Enabled {
			// Heal an annotation that does not match (e.g. written while
			// the API was down and lost, or edited by hand).
			if pod.Annotations[policy.AnnotationRedirection] != policy.RedirectionEnabled {
				if v, ok := a.status.Wanted(pod.Namespace, pod.Name, string(pod.UID)); !ok || v != policy.RedirectionEnabled {
					a.status.Set(pod.Namespace, pod.Name, uid, policy.RedirectionEnabled)
				}
			}
			return nil
		}
		return a.retryPending(ctx, log, pod, entry)
	}

	// A running pod that belongs in the mesh but was not enrolled through
	// CNI (label added later, or enrolled before we knew): find its netns.
	ips := podIPs(pod)
	if len(ips) == 0 || pod.Status.Phase != corev1.PodRunning {
		return nil // not started yet; its CNI ADD or a later update brings it
	}
	opts, err := iptables.PodOptionsFromAnnotations(a.cfg.Rules, pod.Annotations)
	if err != nil {
		a.metrics.failure("bad_annotation")
		log.Warn("cannot enroll pod", "error", err)
		return nil // retrying cannot help; the next pod update will
	}
	h, err := a.finder.FindOne(ctx, podnetns.Target{UID: uid, IPs: ips})
	if err != nil {
		a.metrics.failure("netns_not_found")
		log.Warn("cannot find the pod's network namespace", "error", err)
		return err
	}
	log.Info("enrolling running pod", "reason", d.Reason, "netns", h.Name())
	_, err = a.enroll(ctx, log, pod, h, ips, opts)
	return err // a pending pod is retried with backoff
}

// errPending marks an enrollment whose rules are in place but that ztunnel has
// not acked; the pod stays registered as pending.
var errPending = errors.New("pod is pending: ztunnel has not acked it")

// enroll programs the pod's rules in the netns open as h (taking ownership of
// h), registers it, and activates it with ztunnel. Rule failure: nothing is
// left behind and the error is returned. ztunnel failure: the pod stays
// registered as pending and an error wrapping errPending is returned.
func (a *Agent) enroll(ctx context.Context, log *slog.Logger, pod *corev1.Pod, h *os.File, ips []netip.Addr, opts iptables.PodOptions) (registry.State, error) {
	uid := string(pod.UID)
	start := time.Now()
	err := withNetNS(h, func(n ns.NetNS) error { return a.rules.ApplyPod(ctx, n, opts) })
	a.metrics.step("rules", start)
	if err != nil {
		a.metrics.failure("rules")
		// Apply is atomic per family, but one family may have landed.
		if derr := withNetNS(h, func(n ns.NetNS) error { return a.rules.DeletePod(context.WithoutCancel(ctx), n) }); derr != nil {
			log.Warn("cleanup after failed rule apply", "error", derr)
		}
		h.Close()
		return registry.Pending, fmt.Errorf("program in-pod rules for %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	sa := pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	a.reg.Put(registry.Entry{
		UID: uid, Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: sa,
		IPs: ips, Netns: h, State: registry.Pending,
	})
	entry, _ := a.reg.Get(uid)
	return a.activate(ctx, log, entry, true)
}

// activate tells ztunnel about a registered pod and, once acked, adds its
// probe IPs and marks it enabled. On failure the pod is pending, and its
// annotation is set to pending when markPending says it does not show that
// already.
func (a *Agent) activate(ctx context.Context, log *slog.Logger, e registry.Entry, markPending bool) (registry.State, error) {
	setPending := func(reason string, err error) (registry.State, error) {
		a.metrics.failure(reason)
		a.reg.SetState(e.UID, registry.Pending)
		if markPending {
			a.status.Set(e.Namespace, e.Name, e.UID, policy.RedirectionPending)
		}
		log.Warn("pod pending", "reason", reason, "error", err)
		return registry.Pending, fmt.Errorf("%w: %w", errPending, err)
	}
	start := time.Now()
	err := a.zt.AddWorkload(ctx, ztunnel.Workload{UID: e.UID, Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount}, e.Netns)
	a.metrics.step("ztunnel_add", start)
	if err != nil {
		reason := "ztunnel"
		var nack *ztunnel.NackError
		switch {
		case errors.Is(err, ztunnel.ErrNoZtunnel):
			reason = "no_ztunnel"
		case errors.As(err, &nack):
			reason = "ztunnel_nack"
		}
		return setPending(reason, err)
	}
	start = time.Now()
	err = a.rules.AddProbeIPs(ctx, e.UID, e.IPs)
	a.metrics.step("probe", start)
	if err != nil {
		return setPending("probe_ips", err)
	}
	if !a.reg.SetState(e.UID, registry.Enabled) {
		return registry.Pending, fmt.Errorf("pod %s/%s was removed while being enrolled", e.Namespace, e.Name)
	}
	a.status.Set(e.Namespace, e.Name, e.UID, policy.RedirectionEnabled)
	log.Info("pod enrolled", "ips", e.IPs)
	return registry.Enabled, nil
}

// verifyRestored finishes a pod that rebuild registered without an annotation
// (see rebuild): it applies the pod's rules, which may or may not be in place
// (re-applying identical rules is a no-op), then activates it like a new
// enrollment. The pod stays registered throughout, so ztunnel, which may
// already serve it, is never told to drop it.
func (a *Agent) verifyRestored(ctx context.Context, log *slog.Logger, pod *corev1.Pod, e registry.Entry) error {
	opts, err := iptables.PodOptionsFromAnnotations(a.cfg.Rules, pod.Annotations)
	if err != nil {
		a.metrics.failure("bad_annotation")
		log.Warn("cannot verify the rules of a restored pod", "error", err)
		return nil // retrying cannot help; the next pod update will
	}
	// Rebuild registers these only with a netns; be safe.
	if e, err = a.ensureNetns(ctx, e); err != nil {
		return err
	}
	start := time.Now()
	err = withNetNS(e.Netns, func(n ns.NetNS) error { return a.rules.ApplyPod(ctx, n, opts) })
	a.metrics.step("rules", start)
	if err != nil {
		a.metrics.failure("rules")
		return fmt.Errorf("program in-pod rules of restored pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	if !a.reg.SetRulesVerified(e.UID) {
		return nil // removed meanwhile
	}
	e.RulesUnverified = false
	log.Info("rules of restored unannotated pod applied")
	_, err = a.activate(ctx, log, e, true)
	return err
}

// retryPending re-activates a pending pod, finding its netns first if a
// restart left it without one.
func (a *Agent) retryPending(ctx context.Context, log *slog.Logger, pod *corev1.Pod, e registry.Entry) error {
	e, err := a.ensureNetns(ctx, e)
	if err != nil {
		return err
	}
	_, err = a.activate(ctx, log, e, !a.showsPending(pod))
	return err
}

// showsPending reports whether pod's redirection annotation says pending,
// or a write making it so is queued: a failed retry then need not write it
// again. A pod that a ztunnel refused in its snapshot is pending in the
// registry while it still shows enabled.
func (a *Agent) showsPending(pod *corev1.Pod) bool {
	if v, ok := a.status.Wanted(pod.Namespace, pod.Name, string(pod.UID)); ok {
		return v == policy.RedirectionPending
	}
	return pod.Annotations[policy.AnnotationRedirection] == policy.RedirectionPending
}

// ensureNetns returns e with a netns handle, finding it with a /proc scan
// when a restart left the pod without one.
func (a *Agent) ensureNetns(ctx context.Context, e registry.Entry) (registry.Entry, error) {
	if e.Netns != nil {
		return e, nil
	}
	h, err := a.finder.FindOne(ctx, podnetns.Target{UID: e.UID, IPs: e.IPs})
	if err != nil {
		a.metrics.failure("netns_not_found")
		return e, err
	}
	if !a.reg.SetNetns(e.UID, h) {
		return e, fmt.Errorf("pod %s/%s left the registry while its netns was found", e.Namespace, e.Name)
	}
	cur, _ := a.reg.Get(e.UID)
	return cur, nil
}

// removeFromMesh undoes everything enrollment did for a running pod. Every
// step is idempotent; on error the pod stays registered and is retried.
//
// The rules go first and ztunnel is told only once they are gone: a pod
// whose rules cannot be deleted (its netns not found, iptables failing)
// still has its traffic captured, so it stays in ztunnel, in the registry
// and annotated, and is retried, rather than being left captured with
// nobody proxying it.
func (a *Agent) removeFromMesh(ctx context.Context, pod *corev1.Pod, e registry.Entry, reason policy.Reason) error {
	log := a.podLog(e.Namespace, e.Name, e.UID)
	if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
		withNS, err := a.ensureNetns(ctx, e)
		if err == nil {
			err = withNetNS(withNS.Netns, func(n ns.NetNS) error { return a.rules.DeletePod(ctx, n) })
		}
		if err != nil {
			a.metrics.failure("removal")
			log.Warn("cannot delete the pod's rules; it stays in the mesh and is retried", "reason", reason, "error", err)
			return fmt.Errorf("remove pod %s/%s from the mesh: delete rules: %w", e.Namespace, e.Name, err)
		}
	}
	if err := a.release(ctx, log, e, string(reason)); err != nil {
		return err
	}
	a.status.Set(pod.Namespace, pod.Name, e.UID, "")
	log.Info("pod removed from the mesh", "reason", reason)
	return nil
}

// forget drops a pod whose sandbox or object is gone. Rules are not touched:
// the namespace is going away with the pod.
func (a *Agent) forget(ctx context.Context, e registry.Entry, reason string) error {
	log := a.podLog(e.Namespace, e.Name, e.UID)
	if err := a.release(ctx, log, e, reason); err != nil {
		return err
	}
	log.Info("pod forgotten", "reason", reason)
	return nil
}

// release tells every ztunnel to drop the pod and removes its probe entry;
// only when both succeeded does the pod leave the registry, so a failure is
// retried whole.
//
// From its first call the pod is Releasing: out of every later snapshot, and a
// reconcile finishes the release before anything else.
func (a *Agent) release(ctx context.Context, log *slog.Logger, e registry.Entry, reason string) error {
	a.reg.SetReleasing(e.UID)
	var errs []error
	if err := a.zt.DelWorkload(ctx, e.UID); err != nil {
		errs = append(errs, fmt.Errorf("ztunnel del: %w", err))
	}
	if err := a.rules.RemoveProbeIPs(ctx, e.UID, e.IPs); err != nil {
		errs = append(errs, fmt.Errorf("remove probe IPs: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		a.metrics.failure("removal")
		log.Warn("releasing pod failed, will retry", "reason", reason, "error", err)
		return err
	}
	a.reg.Delete(e.UID)
	a.metrics.removals.WithLabelValues(reason).Inc()
	return nil
}

// rebuild fills the registry after a restart, with one /proc pass for all the
// pods' namespaces, so a reconnecting ztunnel never drops a live pod:
//
//   - this node's pods annotated enabled or pending are registered in that
//     state; those whose netns is not found are still registered (ztunnel
//     gets Keep for them). Their rules are left alone.
//   - this node's other running (non-terminal) pods that the policy puts in
//     the mesh are registered as pending when their netns is found: the agent
//     may have died after ztunnel took such a pod but before its annotation
//     landed (the patch is queued, e.g. during an API outage). Their rules are
//     marked unverified, so the reconcile that follows applies them (a no-op
//     when they are in place) before sending a fresh Add. Those whose netns is
//     not found are left to that reconcile: a Keep for a pod ztunnel may never
//     have had is pointless.
func (a *Agent) rebuild(ctx context.Context) {
	type candidate struct {
		pod       *corev1.Pod
		annotated bool
	}
	var cands []candidate
	var targets []podnetns.Target
	for _, obj := range a.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			continue
		}
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		annotated := false
		switch p.Annotations[policy.AnnotationRedirection] {
		case policy.RedirectionEnabled, policy.RedirectionPending:
			annotated = true
		}
		if !annotated {
			if len(podIPs(p)) == 0 {
				continue // no sandbox network yet: its CNI ADD is still to come
			}
			d, err := a.decide(ctx, p)
			if err != nil || !d.InMesh {
				continue // the reconcile decides again (and retries API errors)
			}
			if _, err := iptables.PodOptionsFromAnnotations(a.cfg.Rules, p.Annotations); err != nil {
				continue // never enrollable as it is; the reconcile reports it
			}
		}
		cands = append(cands, candidate{pod: p, annotated: annotated})
		targets = append(targets, podnetns.Target{UID: string(p.UID), IPs: podIPs(p)})
	}
	if len(cands) == 0 {
		return
	}
	start := time.Now()
	found, err := a.finder.Find(ctx, targets)
	if err != nil {
		a.log.Warn("scanning host proc for pod netns failed; annotated pods will be kept as they are", "error", err)
		found = nil
	}
	restored, unannotated := 0, 0
	for _, c := range cands {
		p := c.pod
		h := found[string(p.UID)]
		log := a.podLog(p.Namespace, p.Name, string(p.UID))
		if !c.annotated && h == nil {
			log.Info("in-mesh pod without annotation: netns not found, left to the reconcile")
			continue
		}
		st := registry.Pending
		if p.Annotations[policy.AnnotationRedirection] == policy.RedirectionEnabled {
			st = registry.Enabled
		}
		sa := p.Spec.ServiceAccountName
		if sa == "" {
			sa = "default"
		}
		a.reg.Put(registry.Entry{
			UID: string(p.UID), Name: p.Name, Namespace: p.Namespace, ServiceAccount: sa,
			IPs: podIPs(p), Netns: h, State: st, RulesUnverified: !c.annotated,
		})
		restored++
		if !c.annotated {
			unannotated++
		}
		log.Info("restored pod", "state", st.String(), "netns_found", h != nil, "annotated", c.annotated)
	}
	a.log.Info("registry rebuilt", "pods", restored, "unannotated", unannotated, "netns_found", len(found), "took", time.Since(start))
}

// Snapshot implements ztunnel.SnapshotSource from the registry.
func (a *Agent) Snapshot() []ztunnel.SnapshotEntry {
	return SnapshotOf(a.reg)
}

// SnapshotOf lists reg as a ztunnel snapshot. The ztunnel server is created
// before the agent, so it can use this through a small adapter.
func SnapshotOf(reg *registry.Registry) []ztunnel.SnapshotEntry {
	list := reg.List()
	out := make([]ztunnel.SnapshotEntry, 0, len(list))
	for _, e := range list {
		if e.Releasing {
			continue // being dropped: a new ztunnel must not take it
		}
		out = append(out, ztunnel.SnapshotEntry{
			Workload: ztunnel.Workload{UID: e.UID, Name: e.Name, Namespace: e.Namespace, ServiceAccount: e.ServiceAccount},
			Netns:    e.Netns,
		})
	}
	return out
}

// RegistrySnapshot adapts a registry to ztunnel.SnapshotSource.
type RegistrySnapshot struct{ Reg *registry.Registry }

var _ ztunnel.SnapshotRefusalObserver = RegistrySnapshot{}

// Snapshot implements ztunnel.SnapshotSource.
func (r RegistrySnapshot) Snapshot() []ztunnel.SnapshotEntry { return SnapshotOf(r.Reg) }

// SnapshotRefused implements ztunnel.SnapshotRefusalObserver: a pod that a
// (new) ztunnel refused in its snapshot is not carried by it, whatever the
// agent believed, so an enabled pod goes back to pending. The agent retries
// every pending pod when that snapshot is acked.
func (r RegistrySnapshot) SnapshotRefused(uid string, _ error) {
	r.Reg.SetStateIf(uid, registry.Enabled, registry.Pending)
}

func podIPs(p *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && p.Status.PodIP != "" {
		if a, err := netip.ParseAddr(p.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// withNetNS runs fn with the netns open as h, through /proc/self/fd so the
// original path (maybe already unmounted) does not matter.
func withNetNS(h *os.File, fn func(ns.NetNS) error) error {
	n, err := ns.GetNS(fmt.Sprintf("/proc/self/fd/%d", h.Fd()))
	if err != nil {
		return fmt.Errorf("reopen netns %s: %w", h.Name(), err)
	}
	defer n.Close()
	return fn(n)
}

// openNetns opens path and checks it is a network namespace.
func openNetns(path string) (*os.File, error) {
	if path == "" {
		return nil, errors.New("no netns path")
	}
	h, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open netns: %w", err)
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(h.Fd()), &st); err != nil {
		h.Close()
		return nil, fmt.Errorf("statfs netns %s: %w", path, err)
	}
	if st.Type != unix.NSFS_MAGIC && st.Type != unix.PROC_SUPER_MAGIC {
		h.Close()
		return nil, fmt.Errorf("%s is not a network namespace (filesystem type %#x)", path, st.Type)
	}
	return h, nil
}
