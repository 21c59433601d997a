package agent

import (
	"context"
	"time"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// Config configures an Agent. DefaultConfig holds the defaults; New takes a
// zero field from there.
type Config struct {
	NodeName string
	Policy   policy.Config
	// DNSCapture is the node's default for pods without the dns-capture
	// annotation.
	DNSCapture bool
	// HostProc is the host's /proc, scanned for running pods' netns.
	HostProc string
	// FailPending makes a CNI ADD fail when the pod's rules are in place but
	// ztunnel did not ack it (the pod is then released again). By default
	// such a pod starts: its traffic is captured and held by the redirect
	// until ztunnel takes the pod over.
	FailPending bool
	// PodLookupTimeout bounds how long a CNI ADD waits for a pod the API does
	// not know yet. CacheWait is the first part of it, during which only
	// the informer is waited on; then direct GETs follow with capped
	// exponential backoff.
	PodLookupTimeout, CacheWait time.Duration
	// RetryBaseDelay..RetryMaxDelay is the per-pod backoff of failed syncs,
	// including pending pods.
	RetryBaseDelay, RetryMaxDelay time.Duration
	// Workers sync pods concurrently (informer events, retries).
	Workers int
	// PodConditionType is the pod condition the agent maintains on the
	// pods it enrolls (in the same write as the annotation).
	PodConditionType string
	// MissingGateEvents records a Warning Event on a mesh pod that joins
	// the mesh without the readiness gate admission would have added
	// (missinggate.go). Off where no admission adds the gate on purpose
	// (the chart's readinessGate.mechanism none): every mesh pod would
	// cost an Event.
	MissingGateEvents bool
	// VerifyInterval is the period of the drift pass (jittered); 0 = off.
	VerifyInterval time.Duration
	// IPv6 says the rule manager captures IPv6: when false, a pod with an
	// IPv6 address is refused (its IPv6 traffic would bypass ztunnel).
	IPv6 bool
	// RunDir holds the pod state file (netns path and inode per pod,
	// recorded at CNI ADD; tmpfs, so gone after a reboot like the
	// namespaces). Empty: no state file.
	RunDir string
	// MaxParallelAdds bounds the CNI ADDs enrolling at once; more wait
	// (within their deadline). Each runs iptables-restore in the pod's
	// netns, so this bounds the processes a burst of new pods forks.
	MaxParallelAdds int
	// HandOver, when set, is asked once as Run stops (the workers done,
	// the registry still open) whether another node agent takes the node
	// over: a non-nil SuccessorRules is that agent's rule backend, and every
	// enrolled pod's rules are moved there (handover.go). nil: nothing moves
	// (an upgrade or a restart).
	HandOver func(ctx context.Context) (SuccessorRules, error)
	// HandOverTimeout bounds the handover (DefaultHandOverTimeout when 0),
	// and the release at an uninstall without one.
	HandOverTimeout time.Duration
	// Uninstalling, when set, is asked as Run stops when HandOver gave no
	// successor: true means ambientd is being uninstalled from the node
	// with no node agent after it, and the pods whose condition is False
	// are released (uninstall.go).
	Uninstalling func(ctx context.Context) bool
	// ZtunnelGrace is how long the node may be without a ztunnel that
	// serves it (connected, snapshot acked) before every enabled pod is
	// Unserved: condition False/ZtunnelUnavailable, so its Services stop
	// sending it traffic that nothing proxies (served.go). 0 disables it.
	ZtunnelGrace time.Duration
}

// DefaultZtunnelGrace covers one ztunnel container restart (kubelet
// restarts a crashed container at once the first time; ztunnel reconnects
// and acks its snapshot within a second or two) but not a crash loop
// (kubelet's back-off waits 10 s, then 20 s, …). A rolling upgrade the way
// Istio's ztunnel chart does it (maxSurge 1, maxUnavailable 0) has no gap at
// all. See docs/readiness.md, "When ztunnel is gone".
const DefaultZtunnelGrace = 5 * time.Second

// DefaultConfig returns the defaults (the flags of `ambientd run` show them).
func DefaultConfig() Config {
	return Config{
		Policy:            policy.DefaultConfig(),
		DNSCapture:        true,
		HostProc:          "/proc",
		PodLookupTimeout:  10 * time.Second,
		CacheWait:         500 * time.Millisecond,
		RetryBaseDelay:    200 * time.Millisecond,
		RetryMaxDelay:     30 * time.Second,
		Workers:           4,
		PodConditionType:  podmeta.ConditionEnrolled,
		MissingGateEvents: true,
		VerifyInterval:    60 * time.Second,
		IPv6:              iptables.DefaultIPv6,
		RunDir:            "/var/run/ambientd",
		MaxParallelAdds:   16,
		ZtunnelGrace:      DefaultZtunnelGrace,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.HostProc == "" {
		c.HostProc = d.HostProc
	}
	if c.PodLookupTimeout <= 0 {
		c.PodLookupTimeout = d.PodLookupTimeout
	}
	if c.CacheWait <= 0 {
		c.CacheWait = d.CacheWait
	}
	if c.RetryBaseDelay <= 0 {
		c.RetryBaseDelay = d.RetryBaseDelay
	}
	if c.RetryMaxDelay <= 0 {
		c.RetryMaxDelay = d.RetryMaxDelay
	}
	if c.Workers <= 0 {
		c.Workers = d.Workers
	}
	if c.PodConditionType == "" {
		c.PodConditionType = d.PodConditionType
	}
	if c.MaxParallelAdds <= 0 {
		c.MaxParallelAdds = d.MaxParallelAdds
	}
	if c.Policy.CapturableRuntimeHandlers == nil {
		c.Policy.CapturableRuntimeHandlers = d.Policy.CapturableRuntimeHandlers
	}
	return c
}
