package podmeta

// Names Istio's sidecar injector writes and its istio-cni reads for a pod
// with an istio-proxy sidecar (docs/sidecar.md). AnnotationSidecarStatus
// (podmeta.go) marks an injected pod.
const (
	// AnnotationSidecarInject (a label, or an annotation when the label
	// key is absent) set to a false value opts the pod out.
	AnnotationSidecarInject = "sidecar.istio.io/inject"
	// AnnotationInterceptionMode is REDIRECT (default) or TPROXY.
	AnnotationInterceptionMode = "sidecar.istio.io/interceptionMode"

	AnnotationIncludeOutboundIPRanges = "traffic.sidecar.istio.io/includeOutboundIPRanges"
	AnnotationExcludeOutboundIPRanges = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	AnnotationIncludeInboundPorts     = "traffic.sidecar.istio.io/includeInboundPorts"
	AnnotationExcludeInboundPorts     = "traffic.sidecar.istio.io/excludeInboundPorts"
	AnnotationIncludeOutboundPorts    = "traffic.sidecar.istio.io/includeOutboundPorts"
	AnnotationExcludeOutboundPorts    = "traffic.sidecar.istio.io/excludeOutboundPorts"
	AnnotationExcludeInterfaces       = "traffic.sidecar.istio.io/excludeInterfaces"
	// AnnotationKubevirtInterfaces is the deprecated name of
	// AnnotationRerouteVirtualInterfaces, read only when that is absent.
	AnnotationKubevirtInterfaces = "traffic.sidecar.istio.io/kubevirtInterfaces"

	// LabelBrokenPod is the label the repair controller's label mode puts
	// on a pod whose istio-validation failed (Istio's default key; value
	// "true").
	LabelBrokenPod = "cni.istio.io/uninitialized"
)
