package registry

// Phase is where a pod is in its life with the agent. The redirection
// annotation (and, later, the pod condition) is derived from it in one place,
// the agent's statusFor.
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
	// Pending: rules are in place, ztunnel has not acked the pod (or the
	// probe entry failed). Traffic is captured and held.
	Pending
	// Enabled: ztunnel acked the pod and its IPs are in the probe set.
	Enabled
	// Releasing: the pod's rules are gone (or the pod is) and ztunnel is
	// being told to drop it; it is out of every snapshot. A release that
	// cannot finish is retried before anything else happens to the pod.
	Releasing
)

// moves lists every phase move; staying in a phase is always allowed.
// This table is the lifecycle: read it before adding a move.
var moves = map[Phase][]Phase{
	// New pods: CNI ADD or a running pod found later (Pending); a
	// restart's rebuild (Unverified, Pending or Enabled from the annotation;
	// Pending for any pod whose netns is not found).
	Absent: {Unverified, Pending, Enabled},
	// Rules applied: activate as a pending pod. Or the pod leaves.
	Unverified: {Pending, Releasing},
	// Acked (Enabled) or the pod leaves.
	Pending: {Enabled, Releasing},
	// A failed re-add, a ztunnel that refused the pod in its snapshot or a
	// handover, or rules that cannot be repaired (Pending), or the pod leaves.
	Enabled: {Pending, Releasing},
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
	}
	return "unknown"
}
