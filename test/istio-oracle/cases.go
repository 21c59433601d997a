package main

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// family is the address family of the pod's interfaces as the CNI plugin sees
// them inside the pod netns (Istio derives IPv6 support from them).
type family string

const (
	v4   family = "ipv4"      // eth0 10.244.0.17/24
	v6   family = "ipv6"      // eth0 fd00:10:244::11/64
	dual family = "dualstack" // eth0 10.244.0.17/24 then fd00:10:244::11/64
)

// profile is the injector configuration: the istio-sidecar-injector ConfigMap
// rendered from Istio's charts with istioctl's renderer.
type profile string

const (
	// profileCNI: `profile=ambient` (istiod + istio-cni + ztunnel): the
	// injector runs in CNI mode (pilot.cni.enabled) and adds istio-validation.
	profileCNI profile = "ambient"
	// profileNoCNI: `profile=default`: the injector adds the privileged
	// istio-init container instead.
	profileNoCNI profile = "default"
)

// oracleCase is one row of the rule-equality table: an input pod, what is
// done to it, and the pod's address family at CNI ADD.
type oracleCase struct {
	name string
	doc  string // one line: what the case covers

	profile profile // default profileCNI
	family  family  // default v4

	namespace   string            // default "demo"
	podName     string            // default "app"
	annotations map[string]string // on the input pod
	labels      map[string]string // on the input pod
	// proxyMetadata becomes the proxy.istio.io/config annotation, which the
	// injector turns into istio-proxy env (DNS capture, dual stack, ...).
	proxyMetadata map[string]string
	hostNetwork   bool
	// proxyUID/GID declare an istio-proxy container with that securityContext
	// in the input pod (the injector merges the user's container fields).
	proxyUID, proxyGID *int64

	// afterAnnotations/afterLabels are set on the injected pod before the
	// plugin sees it (a value the injector would refuse, or a change after
	// injection); an empty value deletes the key.
	afterAnnotations map[string]string
	afterLabels      map[string]string

	// notKubernetes runs CNI ADD without K8S_POD_* args.
	notKubernetes bool
}

func (c oracleCase) withDefaults() oracleCase {
	if c.profile == "" {
		c.profile = profileCNI
	}
	if c.family == "" {
		c.family = v4
	}
	if c.namespace == "" {
		c.namespace = "demo"
	}
	if c.podName == "" {
		c.podName = "app"
	}
	return c
}

// inputPod is the pod a user would apply: one app container, the case's
// annotations and labels.
func (c oracleCase) inputPod() *corev1.Pod {
	ann := map[string]string{}
	for k, v := range c.annotations {
		ann[k] = v
	}
	if len(c.proxyMetadata) > 0 {
		s := "proxyMetadata:\n"
		for _, k := range sortedKeys(c.proxyMetadata) {
			s += "  " + k + ": \"" + c.proxyMetadata[k] + "\"\n"
		}
		ann["proxy.istio.io/config"] = s
	}
	labels := map[string]string{"app": c.podName}
	for k, v := range c.labels {
		labels[k] = v
	}
	pod := &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{
			Name:        c.podName,
			Namespace:   c.namespace,
			Labels:      labels,
			Annotations: ann,
		},
		Spec: corev1.PodSpec{
			HostNetwork: c.hostNetwork,
			Containers: []corev1.Container{{
				Name:  "app",
				Image: "registry.local/app:1",
				Ports: []corev1.ContainerPort{{ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
			}},
		},
	}
	if len(ann) == 0 {
		pod.Annotations = nil
	}
	if c.proxyUID != nil || c.proxyGID != nil {
		pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{
			Name:  "istio-proxy",
			Image: "auto",
			SecurityContext: &corev1.SecurityContext{
				RunAsUser:  c.proxyUID,
				RunAsGroup: c.proxyGID,
			},
		})
	}
	return pod
}

const (
	annInterception   = "sidecar.istio.io/interceptionMode"
	annInclCIDR       = "traffic.sidecar.istio.io/includeOutboundIPRanges"
	annExclCIDR       = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	annInclIn         = "traffic.sidecar.istio.io/includeInboundPorts"
	annExclIn         = "traffic.sidecar.istio.io/excludeInboundPorts"
	annInclOut        = "traffic.sidecar.istio.io/includeOutboundPorts"
	annExclOut        = "traffic.sidecar.istio.io/excludeOutboundPorts"
	annExclIfaces     = "traffic.sidecar.istio.io/excludeInterfaces"
	annKubevirt       = "traffic.sidecar.istio.io/kubevirtInterfaces"
	annReroute        = "istio.io/reroute-virtual-interfaces"
	annInject         = "sidecar.istio.io/inject"
	annStatus         = "sidecar.istio.io/status"
	annNativeSidecar  = "sidecar.istio.io/nativeSidecar"
	annStatusPort     = "status.sidecar.istio.io/port"
	annInjectTemplate = "inject.istio.io/templates"
)

// cases is the rule-equality table. Names are file names under
// testdata/sidecar/ and stay stable: phase-2 tests refer to them.
var cases = []oracleCase{
	// Programmed: REDIRECT.
	{name: "redirect-default", doc: "chart defaults, native sidecar (istio-proxy in initContainers)"},
	{name: "redirect-regular-container", doc: "istio-proxy as a regular container (sidecar.istio.io/nativeSidecar=false)",
		annotations: map[string]string{annNativeSidecar: "false"}},
	{name: "status-port", doc: "status.sidecar.istio.io/port: the injector folds it into excludeInboundPorts",
		annotations: map[string]string{annStatusPort: "15222"}},
	{name: "inbound-ports-include", doc: "includeInboundPorts list plus excludeInboundPorts",
		annotations: map[string]string{annInclIn: "8080,9090", annExclIn: "9091"}},
	{name: "inbound-ports-exclude", doc: "excludeInboundPorts with include '*'",
		annotations: map[string]string{annExclIn: "8081,8082"}},
	{name: "inbound-ports-empty", doc: "includeInboundPorts empty: no inbound capture",
		annotations: map[string]string{annInclIn: ""}},
	{name: "ports-with-spaces", doc: "port lists with spaces after commas",
		annotations: map[string]string{annInclIn: "8080, 9090", annExclOut: "5432, 6379"}},
	{name: "outbound-ports", doc: "includeOutboundPorts and excludeOutboundPorts",
		annotations: map[string]string{annInclOut: "3306", annExclOut: "5432,6379"}},
	{name: "outbound-cidrs", doc: "include/exclude outbound IPv4 CIDRs",
		annotations: map[string]string{annInclCIDR: "10.96.0.0/12,192.168.0.0/16", annExclCIDR: "10.96.0.10/32"}},
	{name: "outbound-cidrs-dualstack", doc: "include/exclude outbound CIDRs of both families, ISTIO_DUAL_STACK",
		family: dual, proxyMetadata: map[string]string{"ISTIO_DUAL_STACK": "true"},
		annotations: map[string]string{annInclCIDR: "10.96.0.0/12,fd00:10:96::/112", annExclCIDR: "10.96.0.10/32,fd00:10:96::a/128"}},
	{name: "include-loopback-cidr", doc: "includeOutboundIPRanges with a loopback range drops the lo RETURN rules",
		annotations: map[string]string{annInclCIDR: "127.0.0.0/8", annExclCIDR: "10.0.0.0/8"}},
	{name: "exclude-interfaces", doc: "traffic.sidecar.istio.io/excludeInterfaces",
		annotations: map[string]string{annExclIfaces: "eth1,net1"}},
	{name: "reroute-virtual-interfaces", doc: "istio.io/reroute-virtual-interfaces (KubeVirt)",
		annotations: map[string]string{annReroute: "tap0,tap1"}},
	{name: "kubevirt-interfaces", doc: "deprecated traffic.sidecar.istio.io/kubevirtInterfaces",
		annotations: map[string]string{annKubevirt: "tap0"}},
	{name: "kubevirt-and-reroute", doc: "both interface annotations: reroute-virtual-interfaces wins",
		annotations: map[string]string{annKubevirt: "tap0", annReroute: "tap9"}},
	{name: "reroute-with-cidrs", doc: "reroute interfaces with an outbound CIDR list",
		annotations: map[string]string{annReroute: "tap0", annInclCIDR: "10.96.0.0/12"}},
	{name: "custom-uid-gid", doc: "istio-proxy runAsUser/runAsGroup set by the user",
		proxyUID: ptr.To[int64](1000670000), proxyGID: ptr.To[int64](1000670001)},
	{name: "invalid-drop", doc: "INVALID_DROP=true in istio-proxy env",
		proxyMetadata: map[string]string{"INVALID_DROP": "true"}},
	// DNS.
	{name: "dns-capture", doc: "ISTIO_META_DNS_CAPTURE=true: all port-53 traffic, CT zones",
		proxyMetadata: map[string]string{"ISTIO_META_DNS_CAPTURE": "true"}},
	{name: "dns-capture-ipv6", doc: "DNS capture in an IPv6 pod",
		family: v6, proxyMetadata: map[string]string{"ISTIO_META_DNS_CAPTURE": "true"}},
	{name: "dns-capture-unparseable", doc: "ISTIO_META_DNS_CAPTURE=yes: Istio logs a warning and leaves DNS capture off",
		proxyMetadata: map[string]string{"ISTIO_META_DNS_CAPTURE": "yes"}},
	{name: "dns-capture-custom-uid", doc: "DNS capture with a custom proxy uid/gid",
		proxyUID: ptr.To[int64](1000670000), proxyGID: ptr.To[int64](1000670001),
		proxyMetadata: map[string]string{"ISTIO_META_DNS_CAPTURE": "true"}},
	// TPROXY.
	{name: "tproxy", doc: "interceptionMode TPROXY",
		annotations: map[string]string{annInterception: "TPROXY"}},
	{name: "tproxy-inbound-ports", doc: "TPROXY with an includeInboundPorts list",
		annotations: map[string]string{annInterception: "TPROXY", annInclIn: "8080"}},
	{name: "tproxy-dualstack", doc: "TPROXY in a dual-stack pod with ISTIO_DUAL_STACK",
		family: dual, proxyMetadata: map[string]string{"ISTIO_DUAL_STACK": "true"},
		annotations: map[string]string{annInterception: "TPROXY"}},
	{name: "tproxy-exclude-interfaces", doc: "TPROXY with excluded interfaces (mangle RETURNs too)",
		annotations: map[string]string{annInterception: "TPROXY", annExclIfaces: "eth1"}},
	{name: "tproxy-custom-uid", doc: "TPROXY with a user-set proxy uid/gid (the injector forces 1337 for validation only)",
		annotations: map[string]string{annInterception: "TPROXY"},
		proxyUID:    ptr.To[int64](1000670000), proxyGID: ptr.To[int64](1000670001)},
	// Families.
	{name: "ipv6", doc: "IPv6-only pod", family: v6},
	{name: "dualstack-without-flag", doc: "dual-stack pod without ISTIO_DUAL_STACK: the first address (IPv4) decides, no IPv6 rules",
		family: dual},
	{name: "dualstack", doc: "dual-stack pod with ISTIO_DUAL_STACK=true",
		family: dual, proxyMetadata: map[string]string{"ISTIO_DUAL_STACK": "true"}},

	// Skips (CNI ADD succeeds, no rules).
	{name: "skip-istio-init", doc: "injected without CNI (istio-init present)", profile: profileNoCNI},
	{name: "skip-no-istio-proxy", doc: "sidecar.istio.io/inject=false: not injected, no istio-proxy",
		annotations: map[string]string{annInject: "false"}},
	{name: "skip-gateway", doc: "gateway template: istio-proxy runs `proxy router`",
		annotations: map[string]string{annInjectTemplate: "gateway"}, labels: map[string]string{"istio": "ingressgateway"}},
	{name: "skip-disable-envoy", doc: "DISABLE_ENVOY=true in istio-proxy env",
		proxyMetadata: map[string]string{"DISABLE_ENVOY": "true"}},
	{name: "skip-inject-label-false", doc: "injected pod whose label sidecar.istio.io/inject is false at ADD",
		afterLabels: map[string]string{annInject: "false"}},
	{name: "skip-inject-annotation-false", doc: "injected pod whose annotation sidecar.istio.io/inject is false at ADD",
		afterAnnotations: map[string]string{annInject: "false"}},
	{name: "inject-label-wins", doc: "label sidecar.istio.io/inject=true beats annotation false: programmed",
		afterLabels: map[string]string{annInject: "true"}, afterAnnotations: map[string]string{annInject: "false"}},
	{name: "skip-no-status", doc: "injected pod without sidecar.istio.io/status",
		afterAnnotations: map[string]string{annStatus: ""}},
	{name: "skip-host-network", doc: "hostNetwork pod: the injector skips it (and runtimes never call CNI for it)",
		hostNetwork: true},
	{name: "skip-excluded-namespace", doc: "pod in an excluded namespace (kube-system)", namespace: "kube-system"},
	{name: "skip-not-kubernetes", doc: "CNI ADD without K8S_POD_NAME/NAMESPACE", notKubernetes: true},
	{name: "skip-own-agent-pod", doc: "the agent's own pod (istio-cni-node-* in the agent namespace)",
		namespace: "istio-system", podName: "istio-cni-node-x7k2p"},

	// Errors (CNI ADD fails).
	{name: "error-interception-none", doc: "interceptionMode NONE with istio-proxy and status: NewRedirect rejects it",
		annotations: map[string]string{annInterception: "NONE"}},
	{name: "error-invalid-cidr", doc: "includeOutboundIPRanges with /33",
		annotations: map[string]string{annInclCIDR: "10.0.0.0/33"}},
	{name: "error-exclude-cidr-wildcard", doc: "excludeOutboundIPRanges '*' (no wildcard allowed there)",
		afterAnnotations: map[string]string{annExclCIDR: "*"}},
	{name: "error-invalid-port", doc: "excludeInboundPorts with a non-number",
		annotations: map[string]string{annExclIn: "80,abc"}},
	{name: "error-port-out-of-range", doc: "includeInboundPorts 70000",
		annotations: map[string]string{annInclIn: "70000"}},
	{name: "error-outbound-port-invalid", doc: "excludeOutboundPorts with a non-number",
		annotations: map[string]string{annExclOut: "http"}},
	{name: "error-interface-name-too-long", doc: "excludeInterfaces name over 15 characters",
		annotations: map[string]string{annExclIfaces: "averyveryverylongname0"}},
	{name: "error-reroute-invalid-name", doc: "reroute-virtual-interfaces with a character not allowed in a name",
		annotations: map[string]string{annReroute: "tap0;tap1"}},
	{name: "error-interception-lowercase", doc: "interceptionMode 'tproxy' (values are case-sensitive)",
		afterAnnotations: map[string]string{annInterception: "tproxy"}},
}
