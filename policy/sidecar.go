package policy

import (
	"fmt"
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/podmeta"
)

// SidecarDecision applies Istio's istio-cni skip order to a pod that is not
// ambient, and reports whether its traffic is to be captured for its
// istio-proxy; if not, skip is why, in Istio's words. A skip is a success
// for the pod (it starts as it is). The order is Istio's, first match wins:
//
//  1. a container named istio-init (the pod redirects itself);
//  2. istio-proxy's env DISABLE_ENVOY parses true;
//  3. no istio-proxy, among initContainers or containers;
//  4. istio-proxy's args are "proxy X ..." with X other than sidecar (a
//     gateway: "proxy router");
//  5. sidecar.istio.io/inject — the label when the pod has that label key,
//     else the annotation — parses false (unparseable values are ignored);
//  6. no sidecar.istio.io/status annotation (its value is not read).
//
// The excluded namespaces, hostNetwork and the agent's own pods are
// handled before, by Decide, for both modes.
func SidecarDecision(pod *corev1.Pod) (capture bool, skip string) {
	all := slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers)
	if slices.ContainsFunc(all, func(c corev1.Container) bool { return c.Name == podmeta.ContainerInit }) {
		return false, "excluded due to being already injected with istio-init container"
	}
	proxy := ProxyInfo(pod)
	if v, err := strconv.ParseBool(proxy.Env["DISABLE_ENVOY"]); err == nil && v {
		return false, "excluded due to DISABLE_ENVOY on istio-proxy"
	}
	if !proxy.Found {
		names := make([]string, 0, len(all))
		for _, c := range all {
			names = append(names, c.Name)
		}
		slices.Sort(names)
		return false, fmt.Sprintf("excluded because it does not have istio-proxy container (have %v)", names)
	}
	if proxy.Type != "" && proxy.Type != "sidecar" {
		return false, fmt.Sprintf("excluded %s/%s pod because it has proxy type %s", pod.Namespace, pod.Name, proxy.Type)
	}
	inject, ok := pod.Labels[podmeta.AnnotationSidecarInject]
	if !ok {
		inject = pod.Annotations[podmeta.AnnotationSidecarInject]
	}
	if v, err := strconv.ParseBool(inject); inject != "" && err == nil && !v {
		return false, "excluded due to inject-disabled annotation"
	}
	if _, ok := pod.Annotations[podmeta.AnnotationSidecarStatus]; !ok {
		return false, "excluded due to not containing sidecar annotation"
	}
	return true, ""
}

// Proxy is what Istio reads of a pod's istio-proxy container(s).
type Proxy struct {
	Found bool
	// Env holds the env values (valueFrom counts as empty) of every
	// container named istio-proxy, later ones overriding earlier ones
	// (initContainers first), as Istio merges them.
	Env map[string]string
	// Type is X of args "proxy X ...": sidecar, router, ...
	Type string
	// UID and GID are the last istio-proxy's securityContext runAsUser and
	// runAsGroup (nil when unset).
	UID, GID *int64
}

// ProxyInfo reads the pod's istio-proxy as Istio's plugin does.
func ProxyInfo(pod *corev1.Pod) Proxy {
	p := Proxy{Env: map[string]string{}}
	for _, c := range slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers) {
		if c.Name != podmeta.ContainerProxy {
			continue
		}
		p.Found = true
		for _, e := range c.Env {
			p.Env[e.Name] = e.Value
		}
		if len(c.Args) >= 2 && c.Args[0] == "proxy" {
			p.Type = c.Args[1]
		}
		if c.SecurityContext != nil {
			p.UID, p.GID = c.SecurityContext.RunAsUser, c.SecurityContext.RunAsGroup
		}
	}
	return p
}

func proxyContainer(pod *corev1.Pod) (corev1.Container, bool) {
	for _, c := range slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers) {
		if c.Name == podmeta.ContainerProxy {
			return c, true
		}
	}
	return corev1.Container{}, false
}
