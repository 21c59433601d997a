// Package admin is the agent's local admin API, what `ambientd status` asks:
// JSON over HTTP on a Unix socket that only root may use (mode 0600 and the
// peer's SO_PEERCRED uid checked on every connection). The wire types live
// here so the server and the command share them.
package admin

import "time"

// DefaultSocketPath is where the agent serves the admin API by default.
const DefaultSocketPath = "/var/run/ambientd/admin.sock"

// Paths of the API.
const (
	PathStatus = "/v1/status"
	PathPod    = "/v1/pod" // ?namespace=&name=
)

// Unknown is shown for a field nothing on this agent reports (yet).
const Unknown = "unknown"

// NodeStatus is GET /v1/status.
type NodeStatus struct {
	Node    string    `json:"node"`
	Time    time.Time `json:"time"`
	Version string    `json:"version,omitempty"`
	// Ready is empty when the agent is ready, else its failed checks.
	NotReady []string      `json:"notReady"`
	Ztunnel  ZtunnelStatus `json:"ztunnel"`
	// Plugin is the CNI plugin's install state ("installed", "missing: …")
	// or Unknown.
	Plugin string `json:"plugin"`
	// Taint is the node taint state ("tainted", "untainted", …) or Unknown.
	Taint string `json:"taint"`
	// Readiness lists the node-readiness reasons (empty: ready or Unknown
	// when NodeReadiness is Unknown).
	NodeReadiness string         `json:"nodeReadiness"`
	Readiness     []string       `json:"readinessReasons,omitempty"`
	Phases        map[string]int `json:"phases"`
	Pods          []Pod          `json:"pods"`
	// APIRequestsLastMinute is how many requests the agent sent to the
	// API server in the last minute (nil: not counted).
	APIRequestsLastMinute *int `json:"apiRequestsLastMinute,omitempty"`
}

// ZtunnelStatus is the ztunnel server's state.
type ZtunnelStatus struct {
	Connections   int  `json:"connections"`
	SnapshotAcked bool `json:"snapshotAcked"`
}

// Pod is one pod of this node.
type Pod struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Phase is the agent's lifecycle phase (absent: not held).
	Phase string `json:"phase"`
	// Annotation is the ambient.istio.io/redirection value the pod shows.
	Annotation string `json:"annotation"`
	// ZtunnelAcked: ztunnel acked the pod's Add (phase enabled).
	ZtunnelAcked bool      `json:"ztunnelAcked"`
	LastError    string    `json:"lastError,omitempty"`
	Created      time.Time `json:"created,omitzero"`
	IPs          []string  `json:"ips,omitempty"`
	Netns        string    `json:"netns,omitempty"`
	// MissingGate: in the mesh, but without the readiness gate admission
	// adds (created while the admission webhook or policy did not act).
	MissingGate bool `json:"missingGate,omitempty"`
}

// PodDetail is GET /v1/pod: the pod and the live rules of its netns.
type PodDetail struct {
	Pod   Pod    `json:"pod"`
	Rules string `json:"rules,omitempty"`
	// RulesError says why Rules is empty.
	RulesError string `json:"rulesError,omitempty"`
}
