package cniapi

import "time"

// InstallLease is the install lease: a JSON file beside the plugin binary in
// the host's CNI bin dir (LeaseFile), written by the agent that installed
// the plugin and read by the plugin only when no agent listens on its socket.
// It tells the plugin what the agent would decide for a pod while no agent
// answers: the enrollment policy (Policy), where to read the pod from the
// API (the kubeconfig beside it, KubeconfigSuffix), and which DaemonSet's
// absence proves an uninstall. Only proof lets the plugin remove itself:
// the agent decided to uninstall (LeaseUninstalling), or the API answers
// that the DaemonSet is gone; elapsed time never does. Runtimes ignore it:
// only executables named by a config's "type" are run from the bin dir.
type InstallLease struct {
	// Version is LeaseVersion; a plugin refuses (fails closed on) any other.
	Version int `json:"version"`
	// State is LeaseInstalled or LeaseUninstalling.
	State string `json:"state"`
	// Renewed is when an agent process last wrote the lease: at its start,
	// before anything can fail, then every renewal period while it runs.
	Renewed time.Time `json:"renewed"`
	// TTL (a Go duration) is how long after max(Renewed, the node's boot)
	// the plugin reports the agent as away for long (in its log and the
	// absence record). It never lets a pod through by itself.
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
	// DaemonSetNamespace/DaemonSetName name the agent's DaemonSet: the
	// API answering that it does not exist is the proof of an uninstall
	// nobody finished. Empty: no such proof can be had (fail closed).
	DaemonSetNamespace string `json:"daemonSetNamespace,omitempty"`
	DaemonSetName      string `json:"daemonSetName,omitempty"`
	// Policy is the agent's enrollment policy, which the plugin applies to
	// a pod it reads from the API while no agent answers. Nil: the plugin
	// cannot decide, and every pod waits for the agent.
	Policy *LeasePolicy `json:"policy,omitempty"`
}

// LeasePolicy is the agent's enrollment policy as the plugin needs it (the
// fields of policy.Config, and whether sidecar mode captures).
type LeasePolicy struct {
	ExcludeNamespaces []string          `json:"excludeNamespaces,omitempty"`
	SystemNamespace   string            `json:"systemNamespace,omitempty"`
	ZtunnelLabels     map[string]string `json:"ztunnelLabels,omitempty"`
	SelfLabels        map[string]string `json:"selfLabels,omitempty"`
	// Sidecar: the agent captures pods with an injected istio-proxy.
	Sidecar bool `json:"sidecar"`
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

// KubeconfigSuffix makes the name of the plugin's kubeconfig from the
// plugin binary's: <cni bin dir>/ambientd-cni.kubeconfig, written by the
// installer (mode 0600) from the agent's own credentials and read by the
// plugin only while no agent answers.
const KubeconfigSuffix = ".kubeconfig"

// DefaultLeaseTTL is longer than kubelet's crash-loop backoff cap (5
// minutes) with room to spare: an agent away for longer is reported as
// away for long (it is not coming back on its own).
const DefaultLeaseTTL = 10 * time.Minute

// The bounds of a lease TTL. The TTL never lets a mesh pod start by itself
// (it only makes a plain pod's ADD also ask whether the DaemonSet is gone),
// so the bounds keep it meaningful: below a second every start would count
// as a long absence; above a week no absence ever would.
const (
	MinLeaseTTL = time.Second
	MaxLeaseTTL = 7 * 24 * time.Hour
)
