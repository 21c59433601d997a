package sidecar_test

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	admissioncases "github.com/ambientd/ambientd/admission/cases"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/podmeta"
)

// TestParseRefusesRuleInjection: pod annotations become rule text, so a
// value that tries to smuggle another match, target or line into a rule (or
// into the restore batch) is refused with ErrInvalidAnnotation naming the
// annotation, before anything is programmed; and the rule code's own check
// refuses such options even if built by hand.
func TestParseRefusesRuleInjection(t *testing.T) {
	pod, c := sidecarPod(t, "redirect-default", "uid-attack")
	for key, value := range map[string]string{
		"traffic.sidecar.istio.io/excludeInterfaces":       "eth0 -j ACCEPT",
		"istio.io/reroute-virtual-interfaces":              "tap0\n-A OUTPUT -j ACCEPT",
		"traffic.sidecar.istio.io/kubevirtInterfaces":      `tap0"; drop`,
		"traffic.sidecar.istio.io/includeOutboundIPRanges": "10.0.0.0/8 -j RETURN",
		"traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8\nCOMMIT",
		"traffic.sidecar.istio.io/includeInboundPorts":     "80 -j ACCEPT",
		"traffic.sidecar.istio.io/excludeInboundPorts":     "80\n-F",
		"traffic.sidecar.istio.io/includeOutboundPorts":    "1-65535",
		"traffic.sidecar.istio.io/excludeOutboundPorts":    "*",
		"sidecar.istio.io/interceptionMode":                "REDIRECT -j ACCEPT",
	} {
		t.Run(key, func(t *testing.T) {
			p := pod.DeepCopy()
			p.Annotations[key] = value
			_, err := sidecar.Parse(p, c.IPs())
			if !errors.Is(err, sidecar.ErrInvalidAnnotation) || !strings.Contains(err.Error(), key) {
				t.Errorf("Parse with %s=%q: %v, want ErrInvalidAnnotation naming it", key, value, err)
			}
		})
	}
	for _, o := range []iptables.SidecarOptions{
		{Mode: iptables.InterceptRedirect, ExcludeInterfaces: []string{"eth0 -j ACCEPT"}},
		{Mode: iptables.InterceptRedirect, RerouteInterfaces: []string{"a/b"}},
		{Mode: "NONE"},
		{Mode: iptables.InterceptRedirect, IncludeOutboundCIDRs: []netip.Prefix{{}}},
	} {
		if err := o.Validate(); err == nil {
			t.Errorf("Validate(%+v) accepted", o)
		}
	}
}

// TestParseIPv6Decision: the family follows the pod's addresses as Istio
// decides from the pod's interfaces: the first usable address (IPv4 before
// IPv6 in the kernel's order), or any IPv6 address with ISTIO_DUAL_STACK;
// loopback and link-local addresses do not count; none is an error.
func TestParseIPv6Decision(t *testing.T) {
	pod, _ := sidecarPod(t, "redirect-default", "uid-family")
	dual := pod.DeepCopy()
	for i := range dual.Spec.InitContainers {
		if dual.Spec.InitContainers[i].Name == "istio-proxy" {
			dual.Spec.InitContainers[i].Env = append(dual.Spec.InitContainers[i].Env, corev1EnvVar("ISTIO_DUAL_STACK", "true"))
		}
	}
	a := netip.MustParseAddr
	for _, tc := range []struct {
		name string
		dual bool
		ips  []netip.Addr
		v6   bool
		err  bool
	}{
		{"IPv4 pod", false, []netip.Addr{a("10.0.0.1")}, false, false},
		{"IPv6 pod", false, []netip.Addr{a("fd00::1")}, true, false},
		{"dual-stack without the flag: IPv4 only (Istio)", false, []netip.Addr{a("fd00::1"), a("10.0.0.1")}, false, false},
		{"dual-stack with the flag", true, []netip.Addr{a("10.0.0.1"), a("fd00::1")}, true, false},
		{"link-local ignored", false, []netip.Addr{a("fe80::1"), a("10.0.0.1")}, false, false},
		{"no usable address", false, []netip.Addr{a("127.0.0.1"), a("fe80::1")}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pod
			if tc.dual {
				p = dual
			}
			got, err := sidecar.Parse(p, tc.ips)
			if (err != nil) != tc.err {
				t.Fatalf("Parse: %v, want error %v", err, tc.err)
			}
			if err == nil && got.Options.IPv6 != tc.v6 {
				t.Errorf("IPv6 = %v, want %v", got.Options.IPv6, tc.v6)
			}
		})
	}
}

func corev1EnvVar(name, value string) corev1.EnvVar { return corev1.EnvVar{Name: name, Value: value} }

// TestInterfaceNamesFollowTheSharedTable: sidecar mode reads a pod's
// interface lists with the one interface-name rule the ambient path and the
// pod-annotation admission policy use (admission/cases/annotations.json): a
// reroute-virtual-interfaces value the policy admits is programmed, one it
// refuses is refused here too — so no pod is admitted whose CNI ADD then
// fails for ever. The same rule holds for excludeInterfaces and the
// deprecated kubevirtInterfaces.
func TestInterfaceNamesFollowTheSharedTable(t *testing.T) {
	table, err := admissioncases.LoadAnnotations()
	if err != nil {
		t.Fatal(err)
	}
	pod, c := sidecarPod(t, "redirect-default", "uid-ifnames")
	n := 0
	for _, tc := range table {
		v, ok := tc.Annotations[podmeta.AnnotationRerouteVirtualInterfaces]
		if !ok {
			continue
		}
		n++
		admitted := !slices.Contains(tc.Invalid, podmeta.AnnotationRerouteVirtualInterfaces)
		for _, key := range []string{podmeta.AnnotationRerouteVirtualInterfaces, podmeta.AnnotationExcludeInterfaces, podmeta.AnnotationKubevirtInterfaces} {
			p := pod.DeepCopy()
			p.Annotations[key] = v
			_, err := sidecar.Parse(p, c.IPs())
			if admitted && err != nil {
				t.Errorf("%s: %s=%q is admitted by the policy but refused by sidecar mode (the pod's ADD would fail for ever): %v", tc.Name, key, v, err)
			}
			if !admitted && !errors.Is(err, sidecar.ErrInvalidAnnotation) {
				t.Errorf("%s: %s=%q is refused by the policy but sidecar mode accepts it (%v)", tc.Name, key, v, err)
			}
		}
	}
	if n < 20 {
		t.Fatalf("only %d interface-list cases in the shared table", n)
	}
}
