package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"
)

// PodEvent is one pod sandbox event as the runtime described it to the CNI
// plugin; the CNI server hands it to the CNI edge (CNI.HandleAdd,
// CNI.HandleDel).
type PodEvent struct {
	Name, Namespace string
	// UID may be empty: old runtimes do not pass K8S_POD_UID.
	UID              string
	InfraContainerID string
	// NetnsPath is the pod's network namespace; empty on a DEL whose
	// namespace is already gone.
	NetnsPath string
	// IPs are the pod's addresses from the chain's prevResult, with the
	// prefix length of their subnet.
	IPs []netip.Prefix
	// Interface is the pod-side interface name (CNI_IFNAME).
	Interface string
	// Plugin is what the plugin process measured before its call, and
	// Received when the call reached the agent's server; both only feed
	// ambientd_cni_add_step_duration_seconds (zero: not known).
	Plugin   PluginTimings
	Received time.Time
}

// PluginTimings are the plugin's steps before it called the agent
// (cniapi.PluginTimings).
type PluginTimings struct {
	// Init: the process's Go code began → the plugin's ADD handler.
	// Config: the handler → just before the call.
	Init, Config time.Duration
	// CallStart is the wall clock just before the call.
	CallStart time.Time
}

// Outcome is what CNI.HandleAdd did with a pod it did not fail.
type Outcome int

const (
	// OutcomeUnknown is the zero value; returning it with a nil error is a
	// bug and fails the ADD.
	OutcomeUnknown Outcome = iota
	// Enrolled: in-pod rules applied and ztunnel acknowledged the pod.
	Enrolled
	// Pending: rules applied, ztunnel has not acknowledged yet; the agent
	// retries. The pod may start: its traffic is already captured.
	Pending
	// NotInMesh: the pod does not belong in the mesh; nothing was done.
	NotInMesh
	// SidecarCaptured: the pod has an injected istio-proxy; its traffic
	// was redirected to that proxy (sidecar mode), not to ztunnel.
	SidecarCaptured
)

func (o Outcome) String() string {
	switch o {
	case Enrolled:
		return "enrolled"
	case Pending:
		return "pending"
	case NotInMesh:
		return "not-in-mesh"
	case SidecarCaptured:
		return "sidecar"
	default:
		return fmt.Sprintf("Outcome(%d)", int(o))
	}
}

// LogValue makes slog (whose JSON handler ignores String) log the name, not
// the number.
func (o Outcome) LogValue() slog.Value { return slog.StringValue(o.String()) }

// Domain errors of the core. Errors the agent returns wrap one of these (or
// a context error) with %w, so a transport maps them with errors.Is: the CNI
// server to gRPC codes, the plugin from those to CNI codes. Anything else is
// an internal error.
var (
	// ErrPodUnknown: the Kubernetes API does not know the pod (or knows
	// another pod of that name).
	ErrPodUnknown = errors.New("pod unknown")
	// ErrAPIUnavailable: the pod could not be looked up, the API is
	// unreachable.
	ErrAPIUnavailable = errors.New("kubernetes API unavailable")
	// ErrInvalidPod: the pod cannot be enrolled as it is (e.g. an invalid
	// capture annotation); retrying will not help until it changes.
	ErrInvalidPod = errors.New("invalid pod")
	// ErrNetnsUnusable: the pod's network namespace cannot be opened or
	// found.
	ErrNetnsUnusable = errors.New("pod network namespace unusable")
	// ErrNotCaptured: the pod's rules could not be programmed; nothing is
	// left behind and the pod must not start.
	ErrNotCaptured = errors.New("pod traffic not captured")
	// ErrPending: the rules are in place but ztunnel has not acked the pod.
	ErrPending = errors.New("pod is pending: ztunnel has not acked it")
)
