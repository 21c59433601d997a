package ztunnelproto

// What ztunnel expects of a node agent, as ztunnel 1.24+ ships. The agent's
// servers, its rules and the emulator take these values from here; the
// iptables package (which imports nothing of ours) repeats the mark and ports
// in its rules, and a test in nodeagent checks that they agree.
const (
	// DefaultSocketPath is where ztunnel connects to the node agent.
	DefaultSocketPath = "/var/run/ztunnel/ztunnel.sock"
	// ProxyMark is the SO_MARK ztunnel sets on all its sockets.
	ProxyMark = 0x539
	// OutboundPort, InboundPort and HBONEPort are ztunnel's in-pod listeners
	// (outbound capture, plain-text inbound capture, HBONE inbound).
	OutboundPort = 15001
	InboundPort  = 15006
	HBONEPort    = 15008
	// DNSPort is ztunnel's in-pod DNS proxy.
	DNSPort = 15053
)
