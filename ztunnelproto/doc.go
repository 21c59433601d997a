// Package ztunnelproto is the ZDS protocol spoken between the node agent and
// ztunnel: the generated protobuf types (zds.proto, package
// istio.workload.zds, byte-for-byte compatible with real ztunnel 1.24+), small
// constructors and decoders for them, and Conn, the framing over an AF_UNIX
// SOCK_SEQPACKET socket with file descriptors passed as SCM_RIGHTS.
//
// The package imports nothing of ours and nothing of Kubernetes, so the agent,
// the ztunnel emulator and tests can all share it.
//
// Regenerate zds.pb.go with `make generate`.
package ztunnelproto
