// Package podmeta is the one home of the Istio label, annotation and
// container names and values that the agent, the CNI plugin and the
// admission tools read and write, and of what the agent keeps of a pod
// (Trim). It imports nothing of ours: the plugin shares it. The validation
// of a pod's annotations and the capture options derived from them are
// podopts'.
package podmeta

// Labels and annotations shared with Istio, so pods and namespaces labelled
// for istio-cni behave the same under ambientd.
const (
	// LabelDataplaneMode on a pod or namespace enrolls (ModeAmbient) or
	// opts out (ModeNone).
	LabelDataplaneMode = "istio.io/dataplane-mode"
	ModeAmbient        = "ambient"
	ModeNone           = "none"
	// AnnotationSidecarStatus marks a pod with an injected sidecar.
	AnnotationSidecarStatus = "sidecar.istio.io/status"
	// AnnotationRedirection is what the agent writes: RedirectionEnabled
	// or RedirectionPending, removed when the pod leaves the mesh.
	AnnotationRedirection = "ambient.istio.io/redirection"
	RedirectionEnabled    = "enabled"
	RedirectionPending    = "pending"
	// ConditionEnrolled is the pod condition the agent maintains by
	// default (--pod-condition-type), which a readiness gate names.
	ConditionEnrolled = "ambient.istio.io/enrolled"
	// AnnotationBypassInbound drops inbound capture when true.
	AnnotationBypassInbound = "ambient.istio.io/bypass-inbound-capture"
	// AnnotationDNSCapture overrides the node's DNS capture default.
	AnnotationDNSCapture = "ambient.istio.io/dns-capture"
	// AnnotationRerouteVirtualInterfaces lists (comma separated) the pod's
	// virtual interfaces, e.g. a KubeVirt VM's tap0, whose incoming TCP is
	// sent to ztunnel's outbound port (the VM's traffic is the pod's
	// outbound traffic).
	AnnotationRerouteVirtualInterfaces = "istio.io/reroute-virtual-interfaces"
)
