// Package cniapi is the gRPC API between the ambientd CNI plugin and the
// node agent: cni.proto plus the generated code (regenerate with
// `make generate`). Both sides import it: cniplugin (the plugin) and
// nodeagent/cniserver (the agent). The plugin imports nothing else of ours, so
// keep it free of anything but generated code and constants.
package cniapi

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
