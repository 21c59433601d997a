package cniapi

import "time"

// AbsenceRecord is what the plugin did while no agent answered on its
// socket: a JSON file in the agent's run dir (AbsenceFile, beside the
// socket), updated by every ADD that found no agent and read, reported
// (a node Event, a metric, a log line) and removed by the next agent at
// its start. It is bounded: counts, and the last MaxAbsenceRecent pods.
type AbsenceRecord struct {
	Version int `json:"version"`
	// First and Last are the first and the last ADD that found no agent.
	First time.Time `json:"first"`
	Last  time.Time `json:"last"`
	// Refused: ADDs failed closed (the pod waited); Passed: pods that
	// started because the agent's policy keeps them out of the mesh;
	// Uninstalled: ADDs that finished an uninstall on proof.
	Refused int `json:"refused"`
	// Waiting are the pods (namespace/name) whose ADDs were refused, each
	// once, at most MaxAbsenceWaiting of them.
	Waiting     []string `json:"waiting,omitempty"`
	Passed      int      `json:"passed"`
	Uninstalled int      `json:"uninstalled"`
	// AgentLastSeen is the install lease's last renewal, the last sign of
	// an agent (zero when no ADD could read the lease).
	AgentLastSeen time.Time `json:"agentLastSeen,omitzero"`
	// AwayLong: an ADD found the install lease unrenewed for its TTL.
	AwayLong bool             `json:"awayLong,omitempty"`
	Recent   []AbsenceAttempt `json:"recent,omitempty"`
}

// AbsenceAttempt is one ADD without an agent.
type AbsenceAttempt struct {
	At        time.Time `json:"at"`
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	Pass      bool      `json:"pass"`
	Reason    string    `json:"reason"`
}

// The absence record's file name (in the socket's dir), format version and
// bound.
const (
	AbsenceFile       = "cni-absence.json"
	AbsenceVersion    = 1
	MaxAbsenceRecent  = 10
	MaxAbsenceWaiting = 500
)
