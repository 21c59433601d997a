// Package cniapi is the gRPC API between the ambientd CNI plugin and the
// node agent: cni.proto plus the generated code (regenerate with
// `make generate`). Both sides import it: cniplugin (the plugin) and
// nodeagent/cniserver (the agent). The plugin imports nothing else of ours, so
// keep it free of anything but generated code, constants and the plain
// data both sides agree on.
package cniapi

import "time"

// DefaultSocketPath is where the agent serves CNIEvents and grpc.health.v1,
// and where the plugin looks for it unless its `agentSocket` config says
// otherwise.
const DefaultSocketPath = "/var/run/ambientd/cni.sock"

// HealthService is the grpc.health.v1 service name under which the agent
// reports whether it accepts CNI events.
const HealthService = "ambientd.cni.v1.CNIEvents"

// PluginType is the plugin's "type" in a CNI config (its binary's name); the
// agent looks for it in the runtime's CNI config.
const PluginType = "ambientd-cni"

// DefaultPluginTimeout bounds one ADD's call from the plugin to the agent
// when the plugin's entry sets no timeout, and is what the installer writes
// by default. It covers the agent's worst case: the pod lookup (informer
// wait, then direct GETs), the rules, and a ztunnel ack.
const DefaultPluginTimeout = 30 * time.Second

// The bounds of a plugin timeout. Below the floor an ADD fails before the
// agent can answer it; above the ceiling nothing is gained: the kubelet
// cancels a sandbox's creation after its runtime request timeout (2m by
// default), and a longer wait only holds the runtime's CNI lock.
const (
	MinPluginTimeout = 100 * time.Millisecond
	MaxPluginTimeout = 2 * time.Minute
)

// PluginSettings are the plugin's own keys in its CNI config entry, beside
// CNI's standard ones (type, name, cniVersion, prevResult): the one schema
// that the plugin reads (cniplugin.Config) and the agent's installer writes
// (cniinstall.Entry).
type PluginSettings struct {
	// AgentSocket is the agent's Unix socket; default DefaultSocketPath.
	AgentSocket string `json:"agentSocket,omitempty"`
	// Timeout is a Go duration ("30s"); default DefaultPluginTimeout.
	Timeout string `json:"timeout,omitempty"`
	// ExcludeNamespaces are passed through without asking the agent.
	ExcludeNamespaces []string `json:"excludeNamespaces,omitempty"`
	// LogLevel is debug, info, warn or error; default info.
	LogLevel string `json:"logLevel,omitempty"`
	// LogFile receives the plugin's log (appended); default stderr. Never
	// stdout: that is the CNI result channel.
	LogFile string `json:"logFile,omitempty"`
}
