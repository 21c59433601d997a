package registry

// Phase is where a pod is in its life with the agent. The redirection
// annotation and the pod condition are derived from it in one place, the
// agent's statusFor; so is the pod's host probe entry (see ProbeEntry).
type Phase int

const (
	// Absent: not in the registry (the zero value: a pod never seen, or
	// released).
	Absent Phase = iota
	// Unverified: restored after a restart without an annotation (the agent
	// died before that patch landed) but in the mesh and its netns found.
	// It is in snapshots; its rules may or may not be in place, so they are
	// read back and repaired where they differ before ztunnel is told again.
	Unverified
	// Pending: the pod's current sandbox has our rules (applied or read
	// back) and its probe entry; ztunnel has not acked it in that sandbox.
	// Traffic is captured and held.
	Pending
	// Enabled: as Pending, and ztunnel acked the pod in that sandbox.
	Enabled
	// Releasing: the pod's rules are gone (or the pod is) and ztunnel is
	// being told to drop it; it is out of every snapshot. A release that
	// cannot finish is retried before anything else happens to the pod.
	Releasing
	// Uncaptured: the pod belongs in the mesh but its current sandbox is not
	// known to carry our rules: its sandbox changed or went (a DEL of a pod
	// that still exists, a netns the runtime no longer names or that lost
	// the pod's IPs), its netns was not found after a restart, or its rules
	// could not be repaired. The netns handle, if any, is the pod's current
	// one (nil when it must be found again); no probe entry. Retried: once
	// the sandbox is found and its rules are in place it is Pending again.
	Uncaptured
	// Unserved: as Enabled — our rules and the probe entry in place, ztunnel
	// acked the pod in this sandbox — but no ztunnel has served the node
	// (connected with its snapshot acked) for longer than the agent's
	// grace: the pod's traffic is captured and nobody proxies it. It is in
	// snapshots (Add); once a ztunnel acked one and took the pod's Add it is
	// Enabled again.
	Unserved
)

// moves lists every phase move; staying in a phase is always allowed.
// This table is the lifecycle: read it before adding a move.
var moves = map[Phase][]Phase{
	// New pods: CNI ADD or a running pod found later, rules applied
	// (Pending); a restart's rebuild (Unverified, Pending or Enabled from
	// the annotation and the sandbox check; Unserved for an enabled pod
	// that shows it; Uncaptured for a pod whose netns is not found).
	Absent: {Unverified, Pending, Enabled, Uncaptured, Unserved},
	// Rules read back and repaired: activate as a pending pod. Or its
	// sandbox turns out not to be the pod's (Uncaptured), or it leaves.
	Unverified: {Pending, Uncaptured, Releasing},
	// Acked (Enabled); the sandbox changed or its rules cannot be
	// repaired (Uncaptured); or the pod leaves.
	Pending: {Enabled, Uncaptured, Releasing},
	// A failed re-add, a ztunnel that refused the pod in its snapshot or a
	// handover (Pending: the rules stay); no ztunnel served the node for
	// the grace (Unserved); the sandbox changed or went, or its rules
	// cannot be repaired (Uncaptured); or the pod leaves.
	Enabled: {Pending, Unserved, Uncaptured, Releasing},
	// A ztunnel acked its snapshot and the pod's Add (Enabled) or refused
	// it (Pending); the sandbox changed or went, or its rules cannot be
	// repaired (Uncaptured); or the pod leaves.
	Unserved: {Enabled, Pending, Uncaptured, Releasing},
	// Its current sandbox found and captured (Pending), or it leaves.
	Uncaptured: {Pending, Releasing},
	// Only a finished release leaves Releasing.
	Releasing: {Absent},
}

// canMove reports whether a pod may move from phase from to phase to.
func canMove(from, to Phase) bool {
	if from == to {
		return true
	}
	for _, p := range moves[from] {
		if p == to {
			return true
		}
	}
	return false
}

// ProbeEntry reports whether a pod in phase p has its IPs in the node's
// probe set (kubelet's probes SNATed past the capture): exactly while our
// rules are in place in its current sandbox — Pending, Enabled and
// Unserved. This is the one probe rule (docs/readiness.md): the entry goes
// in with the rules, before ztunnel acks (as Istio does), so a pending pod's
// liveness probes reach it; readiness is held by the pod condition, not by
// failing probes (an unserved pod's liveness probes pass too: restarting it
// would not bring ztunnel back).
// It leaves with the rules: a pod whose sandbox changed, or whose rules are
// gone, never has probes SNATed into an uncaptured sandbox.
func ProbeEntry(p Phase) bool { return p == Pending || p == Enabled || p == Unserved }

func (p Phase) String() string {
	switch p {
	case Absent:
		return "absent"
	case Unverified:
		return "unverified"
	case Pending:
		return "pending"
	case Enabled:
		return "enabled"
	case Releasing:
		return "releasing"
	case Uncaptured:
		return "uncaptured"
	case Unserved:
		return "unserved"
	}
	return "unknown"
}
