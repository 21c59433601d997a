package ztunnelemu

import "time"

// State is a snapshot of everything the emulator has seen; it marshals to the
// JSON served at GET /state.
type State struct {
	// Connected: a connection is up and its hello was sent.
	Connected bool `json:"connected"`
	// CurrentConn is the id of the live connection (0 when none).
	CurrentConn int `json:"currentConn"`
	// Workloads the emulator currently serves, sorted by uid.
	Workloads []Workload `json:"workloads"`
	// Connections in the order they were made.
	Connections []ConnRecord `json:"connections"`
	// Requests received, in order, across all connections.
	Requests []RequestRecord `json:"requests"`
	// Accepted TCP connections on workload listeners (netns mode).
	Accepted []AcceptRecord `json:"accepted"`
	// ProtocolErrors the peer committed; real ztunnel exits on each.
	ProtocolErrors []ProtocolError `json:"protocolErrors"`
	// Nacks: workload key (uid or namespace/name) → error string for Adds.
	Nacks map[string]string `json:"nacks"`
}

// Workload is one workload ztunnel would proxy for.
type Workload struct {
	UID            string `json:"uid"`
	Name           string `json:"name"`
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
	// NetnsInode identifies the network namespace received with the Add.
	NetnsInode uint64 `json:"netnsInode"`
	// ConnID is the connection whose Add installed the workload.
	ConnID int `json:"connID"`
	// Listeners are the addresses bound inside the netns (netns mode).
	Listeners []string `json:"listeners,omitempty"`
}

// ConnRecord is one connection to the agent.
type ConnRecord struct {
	ID int `json:"id"`
	// Snapshot lists the Add/Keep requests received before SnapshotSent.
	Snapshot     []SnapshotItem `json:"snapshot"`
	SnapshotSent bool           `json:"snapshotSent"`
	Closed       bool           `json:"closed"`
}

// SnapshotItem is one Add or Keep of a snapshot.
type SnapshotItem struct {
	Op  string `json:"op"` // "add" or "keep"
	UID string `json:"uid"`
}

// RequestRecord is one request as received, and how it was answered.
type RequestRecord struct {
	ConnID         int    `json:"connID"`
	Op             string `json:"op"`
	UID            string `json:"uid,omitempty"`
	Name           string `json:"name,omitempty"`
	Namespace      string `json:"namespace,omitempty"`
	ServiceAccount string `json:"serviceAccount,omitempty"`
	FDs            int    `json:"fds"`
	NetnsInode     uint64 `json:"netnsInode,omitempty"`
	// AckError is the error sent back ("" = OK).
	AckError string `json:"ackError,omitempty"`
	// ProtocolError is set when the request was a protocol violation (no
	// ack was sent, the connection was closed).
	ProtocolError string `json:"protocolError,omitempty"`
	// At is when the request arrived (wall clock: tests compare it with
	// other processes' timestamps, e.g. an app's start in its log).
	At time.Time `json:"at"`
}

// AcceptRecord is one TCP connection a workload listener accepted.
type AcceptRecord struct {
	UID    string `json:"uid"`
	Port   int    `json:"port"` // the listener's port: 15001, 15006 or 15008
	Remote string `json:"remote"`
	Local  string `json:"local"`
	// OrigDst is the pre-REDIRECT destination (SO_ORIGINAL_DST); empty with
	// OrigDstError set when the connection was not NATed.
	OrigDst      string `json:"origDst,omitempty"`
	OrigDstError string `json:"origDstError,omitempty"`
	// At is when the connection was accepted (wall clock).
	At time.Time `json:"at"`
}

// ProtocolError is a violation real ztunnel would exit on.
type ProtocolError struct {
	ConnID  int    `json:"connID"`
	Message string `json:"message"`
}

// Workload returns the workload with uid, if served.
func (s State) Workload(uid string) (Workload, bool) {
	for _, w := range s.Workloads {
		if w.UID == uid {
			return w, true
		}
	}
	return Workload{}, false
}

// Conn returns the record of connection id.
func (s State) Conn(id int) (ConnRecord, bool) {
	for _, c := range s.Connections {
		if c.ID == id {
			return c, true
		}
	}
	return ConnRecord{}, false
}

// RequestsOn returns the requests received on connection id, in order.
func (s State) RequestsOn(id int) []RequestRecord {
	var out []RequestRecord
	for _, r := range s.Requests {
		if r.ConnID == id {
			out = append(out, r)
		}
	}
	return out
}
