package daemon

import (
	"errors"
	"flag"
	"fmt"
	"strconv"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/repair"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/settings"
	"github.com/ambientd/ambientd/ztunnelproto"
)

// RegisterFlags binds c's fields to their flags on fs, with the node
// agent's defaults as values: the process's own (sockets, listeners), the
// agent core's (agent.Config.RegisterFlags), node readiness's and sidecar mode's.
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
	c.Agent.RegisterFlags(fs)
	c.NodeReady.RegisterFlags(fs)
	c.Sidecar.RegisterFlags(fs)
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
