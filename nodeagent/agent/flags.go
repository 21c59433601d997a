package agent

import (
	"flag"

	"github.com/ambientd/ambientd/settings"
)

// RegisterFlags binds the agent core's settings to their flags on fs, with
// DefaultConfig's values; Validate names these flags in its errors.
func (a *Config) RegisterFlags(fs *flag.FlagSet) {
	*a = DefaultConfig()
	fs.StringVar(&a.NodeName, "node-name", "", "this node's name (required)")
	fs.StringVar(&a.HostProc, "host-proc", a.HostProc, "host /proc, scanned for running pods' network namespaces")
	fs.Var(settings.List{P: &a.Policy.ExcludeNamespaces}, "exclude-namespaces", "comma-separated `namespaces` never enrolled")
	fs.Var(settings.List{P: &a.Policy.CapturableRuntimeHandlers}, "capturable-runtime-handlers", "comma-separated runtime `handlers` (a RuntimeClass's handler; \"default\" for pods without a RuntimeClass) whose pods' traffic the in-pod rules capture; a mesh pod under any other (gVisor's runsc, Kata's kata-*) has its CNI ADD refused and is never reported in the mesh (docs/agent.md)")
	fs.StringVar(&a.Policy.SystemNamespace, "system-namespace", a.Policy.SystemNamespace, "namespace of the mesh's own pods: only there are app=ztunnel and app=ambientd pods kept out of the mesh")
	fs.BoolVar(&a.DNSCapture, "dns-capture", a.DNSCapture, "capture DNS to ztunnel by default, as Istio does since 1.25 (pod annotation ambient.istio.io/dns-capture overrides)")
	fs.BoolVar(&a.IPv6, "ipv6", a.IPv6, "also capture IPv6 (harmless in IPv4-only pods); with --ipv6=false a pod with an IPv6 address fails its CNI ADD rather than run with IPv6 uncaptured")
	fs.DurationVar(&a.VerifyInterval, "verify-interval", a.VerifyInterval, "period of the drift pass that reads back enrolled pods' rules and the host rules and repairs drift (jittered ±10%; 0 = off)")
	fs.StringVar(&a.RunDir, "run-dir", a.RunDir, "the agent's run directory (tmpfs): holds the pod state file (netns path and inode per pod), tried before the /proc scan on restart")
	fs.BoolVar(&a.FailPending, "fail-pending", false, "fail the CNI ADD of a pod ztunnel has not acked (default: the pod starts with rules in place, held until ztunnel takes it)")
	fs.DurationVar(&a.PodLookupTimeout, "pod-lookup-timeout", a.PodLookupTimeout, "how long a CNI ADD waits for an unknown pod to appear in the API (the informer first, then direct GETs with capped exponential backoff)")
	fs.DurationVar(&a.RetryBaseDelay, "retry-base-delay", a.RetryBaseDelay, "first backoff of a pod whose reconcile failed (pending pods are also retried on every ztunnel snapshot ack)")
	fs.DurationVar(&a.RetryMaxDelay, "retry-max-delay", a.RetryMaxDelay, "cap of the per-pod exponential backoff")
	fs.IntVar(&a.Workers, "workers", a.Workers, "pod syncs run at once from the workqueue (informer events, retries)")
	fs.IntVar(&a.MaxParallelAdds, "max-parallel-adds", a.MaxParallelAdds, "CNI ADDs enrolling at once; more wait within their deadline")
	fs.BoolVar(&a.MissingGateEvents, "missing-gate-events", a.MissingGateEvents, "record a Warning Event (ReadinessGateMissing) on a mesh pod that has no readiness gate though admission would have added one; the gauge ambientd_pods_missing_readiness_gate counts them either way. Off where no admission adds the gate on purpose (the chart's readinessGate.mechanism none)")
	fs.StringVar(&a.PodConditionType, "pod-condition-type", a.PodConditionType, "pod condition the agent maintains on the pods it enrolls (name it in spec.readinessGates)")
	fs.DurationVar(&a.ZtunnelGrace, "ztunnel-grace", a.ZtunnelGrace, "how long the node may be without a ztunnel that acked its snapshot before every enabled pod's condition turns False (reason ZtunnelUnavailable) so its Services stop sending it traffic nothing proxies; 0 = never (docs/readiness.md)")
}
