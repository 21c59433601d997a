package daemon

import (
	"errors"
	"flag"
	"fmt"
	"strconv"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/repair"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/settings"
	"github.com/ambientd/ambientd/ztunnelproto"
)

// RegisterFlags binds c's fields to their flags on fs, with the node
// agent's defaults as values: the process's own (sockets, listeners), the
// agent core's (registerAgentFlags), node readiness's and sidecar mode's.
// CNIConfDir is the installer's --cni-conf-dir (the caller copies it).
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.ZtunnelSocket, "ztunnel-socket", ztunnelproto.DefaultSocketPath, "Unix socket ztunnel connects to")
	fs.StringVar(&c.CNISocket, "cni-socket", cniapi.DefaultSocketPath, "Unix socket the CNI plugin calls")
	fs.StringVar(&c.AdminSocket, "admin-socket", admin.DefaultSocketPath, "Unix socket the status command asks (root only)")
	fs.StringVar(&c.HealthAddr, "health-addr", ":8000", "address of /healthz and /readyz")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", ":15014", "address of /metrics")
	fs.BoolVar(&c.IstioMetrics, "istio-metrics", true, "also export Istio's istio-cni metric names (istio_cni_plugin_requests_total, nodeagent_reconcile_events_total, ztunnel_connected, istio_cni_install_ready, istio_cni_installs_total) beside ambientd's, so alerts written for istio-cni keep working (docs/metrics.md, \"Istio's names\")")
	fs.StringVar(&c.PprofAddr, "pprof-addr", "", "address of Go's profiling endpoints (/debug/pprof/); empty = off. They show the agent's memory and goroutines to whoever reaches them: bind to loopback (127.0.0.1:6060)")
	c.ZtunnelSocketMode = 0o600
	fs.Var(settings.FileMode{P: &c.ZtunnelSocketMode}, "ztunnel-socket-mode", "permission `bits` of the ztunnel socket (octal); widen them (e.g. 0660) for a non-root ztunnel")
	c.ZtunnelAllowedUIDs = []uint32{0}
	fs.Var(settings.UIDs{P: &c.ZtunnelAllowedUIDs}, "ztunnel-allowed-uids", "comma-separated `uids` ztunnel may connect as; any other process that reaches the ztunnel socket (it would receive every pod's network namespace) is refused, logged and counted (SO_PEERCRED)")
	fs.DurationVar(&c.ZtunnelProbeInterval, "ztunnel-probe-interval", ztunnel.DefaultProbeInterval, "how long a ztunnel connection may be idle before the agent probes it (a Del of a uid no pod has, which ztunnel acks and which changes nothing): a ztunnel that does not answer within 5s is hung, its connection dropped and its pods not ready after --ztunnel-grace (reason ZtunnelNotResponding); 1s to 5m")
	registerAgentFlags(&c.Agent, fs)
	c.NodeReady.RegisterFlags(fs)
	c.Sidecar.RegisterFlags(fs)
}

// agentFlags names the flag of each agent.Config field its Validate may
// report (agent.SettingError.Field), registered by registerAgentFlags.
var agentFlags = map[string]string{
	"NodeName":                         "node-name",
	"HostProc":                         "host-proc",
	"RunDir":                           "run-dir",
	"PodConditionType":                 "pod-condition-type",
	"Policy.ExcludeNamespaces":         "exclude-namespaces",
	"Policy.SystemNamespace":           "system-namespace",
	"Policy.CapturableRuntimeHandlers": "capturable-runtime-handlers",
	"PodLookupTimeout":                 "pod-lookup-timeout",
	"RetryBaseDelay":                   "retry-base-delay",
	"RetryMaxDelay":                    "retry-max-delay",
	"ZtunnelGrace":                     "ztunnel-grace",
	"VerifyInterval":                   "verify-interval",
	"Workers":                          "workers",
	"MaxParallelAdds":                  "max-parallel-adds",
}

// registerAgentFlags binds the agent core's settings, with
// agent.DefaultConfig's values. (They belong beside agent.Config; they are
// here while nodeagent/agent is split on another branch.)
func registerAgentFlags(a *agent.Config, fs *flag.FlagSet) {
	*a = agent.DefaultConfig()
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
	fs.StringVar(&a.PodConditionType, "pod-condition-type", a.PodConditionType, "pod condition the agent maintains on the pods it enrolls (name it in spec.readinessGates)")
	fs.DurationVar(&a.ZtunnelGrace, "ztunnel-grace", a.ZtunnelGrace, "how long the node may be without a ztunnel that acked its snapshot before every enabled pod's condition turns False (reason ZtunnelUnavailable) so its Services stop sending it traffic nothing proxies; 0 = never (docs/readiness.md)")
}

// RegisterFlags binds sidecar mode's settings (docs/sidecar.md), with
// Istio's defaults (repair.DefaultConfig).
func (c *SidecarConfig) RegisterFlags(fs *flag.FlagSet) {
	c.Repair = repair.DefaultConfig()
	r := &c.Repair
	fs.Var(enabled{&c.Disabled}, "sidecar", "capture pods with an injected istio-proxy (Istio's istio-cni sidecar mode: rules to the pod's own proxy, never to ztunnel)")
	fs.Var(repairMode{&r.Mode}, "repair-mode", "what the repair controller does with a sidecar pod whose istio-validation init container failed with --repair-init-exit-code: repair (program its rules), delete (needs the deploy/components/repair-delete component), label (needs deploy/components/repair-label) or off")
	fs.StringVar(&r.LabelKey, "repair-label-key", r.LabelKey, "label key the label mode sets")
	fs.StringVar(&r.LabelValue, "repair-label-value", r.LabelValue, "label value the label mode sets")
	fs.StringVar(&r.SidecarAnnotation, "repair-sidecar-annotation", r.SidecarAnnotation, "annotation a pod must carry to be repaired (empty: any pod)")
	fs.StringVar(&r.InitContainerName, "repair-init-container-name", r.InitContainerName, "init container whose failure marks a broken pod")
	fs.Var(exitCode{&r.InitExitCode}, "repair-init-exit-code", "exit `code` of that container that marks a broken pod (0: any)")
	fs.StringVar(&r.InitTerminationMessage, "repair-init-termination-message", "", "termination message that container must have ended with (empty: any)")
	fs.StringVar(&r.LabelSelector, "repair-label-selectors", "", "label selector restricting the pods repaired")
	fs.StringVar(&r.FieldSelector, "repair-field-selectors", "", "field selector restricting the pods repaired (metadata.name, metadata.namespace, spec.serviceAccountName, status.phase)")
}

// enabled is --sidecar: true unless *Disabled.
type enabled struct{ disabled *bool }

func (e enabled) String() string {
	if e.disabled == nil {
		return ""
	}
	return strconv.FormatBool(!*e.disabled)
}

func (e enabled) IsBoolFlag() bool { return true }
func (e enabled) Get() any         { return !*e.disabled }
func (e enabled) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("want true or false")
	}
	*e.disabled = !b
	return nil
}

// repairMode is --repair-mode.
type repairMode struct{ m *repair.Mode }

func (r repairMode) String() string {
	if r.m == nil {
		return ""
	}
	return string(*r.m)
}

func (r repairMode) Get() any { return *r.m }
func (r repairMode) Set(s string) (err error) {
	*r.m, err = repair.ParseMode(s)
	return err
}

// exitCode is --repair-init-exit-code: a process exit code, 0..255.
type exitCode struct{ c *int32 }

func (e exitCode) String() string {
	if e.c == nil {
		return ""
	}
	return fmt.Sprint(*e.c)
}

func (e exitCode) Get() any { return int(*e.c) }
func (e exitCode) Set(s string) error {
	v, err := strconv.Atoi(s)
	if err != nil || v < 0 || v > 255 {
		return errors.New("want 0..255")
	}
	*e.c = int32(v)
	return nil
}
