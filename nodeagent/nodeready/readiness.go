// Package nodeready publishes this node's ambient readiness as a node
// condition and, optionally, removes (and re-adds) the node's startup taint
// from that condition. It only ever writes the one Node whose name it was
// constructed with. See docs/readiness.md.
package nodeready

import (
	"errors"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/cniinstall"
)

// Defaults.
const (
	// DefaultConditionType is the node condition the controller maintains.
	// Node condition types are CamelCase by convention; the prefix keeps it
	// apart from kubelet's and matches the pod condition's domain.
	DefaultConditionType = "ambient.istio.io/NodeReady"
	// DefaultTaintKey is the startup taint Istio's untaint controller uses.
	DefaultTaintKey     = "cni.istio.io/not-ready"
	DefaultGracePeriod  = 30 * time.Second
	DefaultResyncPeriod = 10 * time.Second
	// DefaultHeartbeatPeriod is how often the condition is rewritten when
	// nothing changed, to move its lastHeartbeatTime: a True whose
	// heartbeat is older than a few periods comes from an agent that
	// stopped. Five minutes, as kubelet's unchanged node status since
	// KEP-589: a Node write rewrites the whole object in etcd and reaches
	// every Node watcher, once per node.
	DefaultHeartbeatPeriod = 5 * time.Minute
	// DefaultSettle is how long a False condition holds before it is
	// written (Config.Settle): the ztunnel grace of the pods' conditions,
	// so the node says False no later than its pods do.
	DefaultSettle = 5 * time.Second
)

// Condition reasons, in the order they are checked: the reason names the
// first check that fails; the message lists every failing check.
const (
	ReasonReady              = "Ready"
	ReasonPluginNotInstalled = "PluginNotInstalled"
	// ReasonExclusiveCNI: the plugin is not installed because a primary
	// CNI in exclusive mode renames other configs away (Cilium's
	// cni-exclusive=true; cniinstall.ErrExclusiveCNI).
	ReasonExclusiveCNI        = "ExclusiveCNI"
	ReasonCachesNotSynced     = "CachesNotSynced"
	ReasonZtunnelNotConnected = "ZtunnelNotConnected"
	// ReasonZtunnelNotResponding: the last ztunnel connected stopped
	// answering (no ack within the timeout: hung, its socket open) and was
	// dropped; none serves since.
	ReasonZtunnelNotResponding = "ZtunnelNotResponding"
	ReasonSnapshotNotAcked     = "SnapshotNotAcked"
	ReasonCNISocketNotServing  = "CNISocketNotServing"
	// ReasonInstallLeaseNotWritten: the install lease or the plugin's
	// kubeconfig could not be written (full disk, read-only remount).
	ReasonInstallLeaseNotWritten = "InstallLeaseNotWritten"
)

// ZtunnelReasons are the condition's reasons for a node no ztunnel
// serves.
func ZtunnelReasons() []string {
	return []string{ReasonZtunnelNotConnected, ReasonZtunnelNotResponding, ReasonSnapshotNotAcked}
}

// Event reasons recorded on the Node.
const (
	EventTaintRemoved    = "TaintRemoved"    // Normal: the startup taint was removed
	EventTaintAdded      = "TaintAdded"      // Warning: the taint was added back (--taint-when-unready)
	EventAmbientReady    = "AmbientReady"    // Normal: the condition turned True
	EventAmbientNotReady = "AmbientNotReady" // Warning: the condition turned False (or was first set False)
)

// ZtunnelState is what the agent knows about its ztunnel connection.
type ZtunnelState struct {
	Connected     bool // a ztunnel is connected to the agent's socket
	SnapshotAcked bool // that ztunnel acked the snapshot of the node's pods
	// Unresponsive: the last ztunnel that served was dropped for not
	// answering in time (ztunnel.Status.Unresponsive).
	Unresponsive bool
}

// Inputs are the facts readiness is computed from. They are read on every
// evaluation (on Notify and every resync, and on every /readyz), so they
// must be cheap and safe for concurrent use. All are required.
type Inputs struct {
	// PluginInstalled returns nil when our plugin entry is in the CNI
	// config the container runtime uses, else an error saying why not (it
	// becomes part of the condition's message).
	PluginInstalled func() error
	// AgentStarted reports whether the agent's informer caches are synced
	// and its registry rebuilt from them.
	AgentStarted func() bool
	// Ztunnel reports the ztunnel connection.
	Ztunnel func() ZtunnelState
	// CNIServing reports whether the CNI socket serves the plugin.
	CNIServing func() bool
	// InstallLease, when set (the agent installs the plugin), returns the
	// last install lease write's error: without a current lease the
	// plugin cannot decide as the agent would while none answers.
	InstallLease func() error
}

func (in Inputs) complete() bool {
	return in.PluginInstalled != nil && in.AgentStarted != nil && in.Ztunnel != nil && in.CNIServing != nil
}

// Readiness is a computed condition value.
type Readiness struct {
	Ready   bool
	Reason  string
	Message string
}

// Err is nil when r is ready, else an error with r's message (every
// failed check): /readyz's answer.
func (r Readiness) Err() error {
	if r.Ready {
		return nil
	}
	return errors.New(r.Message)
}

// Status returns the condition status for r.
func (r Readiness) Status() corev1.ConditionStatus {
	if r.Ready {
		return corev1.ConditionTrue
	}
	return corev1.ConditionFalse
}

// Compute evaluates the inputs. It is pure apart from calling them. It is
// the one definition of the node's readiness for the mesh: the node
// condition, the agent's /readyz and `ambientd status` all show what it
// computes.
func Compute(in Inputs) Readiness {
	var reasons, msgs []string
	fail := func(reason, msg string) {
		reasons = append(reasons, reason)
		msgs = append(msgs, msg)
	}
	if err := in.PluginInstalled(); err != nil {
		reason := ReasonPluginNotInstalled
		if errors.Is(err, cniinstall.ErrExclusiveCNI) {
			reason = ReasonExclusiveCNI
		}
		fail(reason, "CNI plugin not installed: "+err.Error())
	}
	if !in.AgentStarted() {
		fail(ReasonCachesNotSynced, "agent caches not synced or registry not rebuilt yet")
	}
	switch zt := in.Ztunnel(); {
	case !zt.Connected && zt.Unresponsive:
		fail(ReasonZtunnelNotResponding, "the node's ztunnel stopped answering (no ack within the timeout) and was dropped; no ztunnel connected since")
	case !zt.Connected:
		fail(ReasonZtunnelNotConnected, "no ztunnel connected")
	case !zt.SnapshotAcked:
		fail(ReasonSnapshotNotAcked, "ztunnel has not acked the node's snapshot")
	}
	if !in.CNIServing() {
		fail(ReasonCNISocketNotServing, "CNI socket not serving")
	}
	if in.InstallLease != nil {
		if err := in.InstallLease(); err != nil {
			fail(ReasonInstallLeaseNotWritten, "install lease not written: "+err.Error())
		}
	}
	if len(reasons) == 0 {
		return Readiness{Ready: true, Reason: ReasonReady, Message: "CNI plugin installed, caches synced, ztunnel connected and snapshot acked, CNI socket serving"}
	}
	return Readiness{Reason: reasons[0], Message: strings.Join(msgs, "; ")}
}

// findCondition returns the node's condition of type t, or nil.
func findCondition(n *corev1.Node, t corev1.NodeConditionType) *corev1.NodeCondition {
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == t {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// desiredCondition returns the condition to write for r, and whether it
// must be written: it differs from cur (nil: absent) in status, reason or
// message, or cur's lastHeartbeatTime is heartbeat old or older (0: only
// changes are written). lastTransitionTime moves only when the status
// changes; a changed reason or message, or a heartbeat, keeps it.
func desiredCondition(cur *corev1.NodeCondition, t corev1.NodeConditionType, r Readiness, now time.Time, heartbeat time.Duration) (corev1.NodeCondition, bool) {
	want := corev1.NodeCondition{
		Type:               t,
		Status:             r.Status(),
		Reason:             r.Reason,
		Message:            r.Message,
		LastHeartbeatTime:  metav1.NewTime(now),
		LastTransitionTime: metav1.NewTime(now),
	}
	if cur == nil {
		return want, true
	}
	if cur.Status == want.Status {
		want.LastTransitionTime = cur.LastTransitionTime
	}
	changed := cur.Status != want.Status || cur.Reason != want.Reason || cur.Message != want.Message
	return want, changed || heartbeatIn(cur, heartbeat, now) == 0
}

// heartbeatIn returns how long until cond's heartbeat is due (0: due now),
// or -1 with no heartbeat (period 0 or no condition).
func heartbeatIn(cond *corev1.NodeCondition, period time.Duration, now time.Time) time.Duration {
	if cond == nil || period <= 0 {
		return -1
	}
	return max(cond.LastHeartbeatTime.Time.Add(period).Sub(now), 0)
}

// falseSince is when the condition last turned False: its
// lastTransitionTime, which the API stores with second precision, refined
// by the precise time this process wrote that transition (wrote: zero when
// it did not, e.g. after an agent restart).
func falseSince(cond *corev1.NodeCondition, wrote time.Time) time.Time {
	ltt := cond.LastTransitionTime.Time
	if !wrote.IsZero() && !wrote.Before(ltt) && wrote.Sub(ltt) < time.Second {
		return wrote
	}
	return ltt
}

// retaintDue says whether a taint-when-unready node whose condition is cond
// should get the taint back at now: only when cond is False and has been
// since at least grace before now (since: see falseSince, so an agent
// restart does not restart the clock). When False but not yet due, wait is
// how long until it is.
func retaintDue(cond *corev1.NodeCondition, since time.Time, grace time.Duration, now time.Time) (due bool, wait time.Duration) {
	if cond == nil || cond.Status != corev1.ConditionFalse {
		return false, 0
	}
	left := since.Add(grace).Sub(now)
	if left <= 0 {
		return true, 0
	}
	return false, left
}

// MeshTaintPrefixes are the prefixes a startup taint key must have: the
// agent adds and removes that taint on its node, and a key outside the
// mesh's own (dedicated, nvidia.com/gpu) would let a compromised node remove
// a taint that keeps workloads away. The chart's schema and the admission
// policy hold the same list.
var MeshTaintPrefixes = []string{"cni.istio.io/", "ambient.istio.io/", "ambientd.io/"}
