package cniapi

import "time"

// InstallLease is the install lease: a JSON file beside the plugin binary in
// the host's CNI bin dir (LeaseFile), written by the agent that installed
// the plugin and read by the plugin only when no agent listens on its socket.
// It tells the plugin whether a missing agent is coming back (fail closed:
// an agent restart, crash or upgrade) or gone for good (an uninstall that
// the agent decided or that nobody finished: the plugin finishes it and lets
// the pod through). Runtimes ignore it: only executables named by a config's
// "type" are run from the bin dir.
type InstallLease struct {
	// Version is LeaseVersion; a plugin refuses (fails closed on) any other.
	Version int `json:"version"`
	// State is LeaseInstalled or LeaseUninstalling.
	State string `json:"state"`
	// Renewed is when an agent process last wrote the lease: at its start,
	// before anything can fail, then every renewal period while it runs.
	Renewed time.Time `json:"renewed"`
	// TTL (a Go duration) is how long after max(Renewed, the node's boot)
	// a lease in state LeaseInstalled with no agent behind it means that
	// nobody is coming back.
	TTL string `json:"ttl"`
	// ConfDir is the host's CNI conf dir (a host path) and ConfName,
	// OwnedName and InPlace the installer's settings, so that the plugin
	// finds what to remove.
	ConfDir   string `json:"confDir"`
	ConfName  string `json:"confName,omitempty"`
	OwnedName string `json:"ownedName,omitempty"`
	InPlace   bool   `json:"inPlace,omitempty"`
	// PID is the writing agent's process id, for people reading the file.
	PID int `json:"pid,omitempty"`
}

// The install lease's format version and states.
const (
	LeaseVersion = 1
	// LeaseInstalled: an agent runs (or ran within TTL) on this node and
	// will be back.
	LeaseInstalled = "installed"
	// LeaseUninstalling: the agent decided to uninstall from this node.
	LeaseUninstalling = "uninstalling"
)

// LeaseSuffix makes the lease's name from the plugin binary's:
// <cni bin dir>/ambientd-cni.lease.
const LeaseSuffix = ".lease"

// DefaultLeaseTTL is longer than kubelet's crash-loop backoff cap (5
// minutes) with room to spare: an agent crash-looping while its DaemonSet
// exists starts, and so renews the lease, more often than that.
const DefaultLeaseTTL = 10 * time.Minute
