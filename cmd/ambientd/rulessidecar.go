package main

import (
	"fmt"
	"io"
	"net/netip"
	"os"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// sidecarArgs are `ambientd rules --sidecar`'s inputs: a pod (a file, as
// Istio's injector produced it), or annotations and istio-proxy settings
// given one by one.
type sidecarArgs struct {
	podFile            string
	ips                listFlag
	proxyEnv           annFlag
	proxyUID, proxyGID int64
}

// sidecarPod returns the pod to read: the file's, or one built from the
// flags (an injected pod with istio-proxy and the status annotation).
func (s sidecarArgs) sidecarPod(ann annFlag) (*corev1.Pod, error) {
	if s.podFile != "" {
		var data []byte
		var err error
		if s.podFile == "-" {
			data, err = io.ReadAll(os.Stdin)
		} else {
			data, err = os.ReadFile(s.podFile)
		}
		if err != nil {
			return nil, fmt.Errorf("--pod: %w", err)
		}
		var p corev1.Pod
		if err := yaml.Unmarshal(data, &p); err != nil {
			return nil, fmt.Errorf("--pod %s: %w", s.podFile, err)
		}
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		for k, v := range ann {
			p.Annotations[k] = v
		}
		return &p, nil
	}
	proxy := corev1.Container{Name: podmeta.ContainerProxy, Args: []string{"proxy", "sidecar"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: &s.proxyUID, RunAsGroup: &s.proxyGID}}
	for k, v := range s.proxyEnv {
		proxy.Env = append(proxy.Env, corev1.EnvVar{Name: k, Value: v})
	}
	annotations := map[string]string{"sidecar.istio.io/status": "{}"}
	for k, v := range ann {
		annotations[k] = v
	}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pod", Namespace: "default", Annotations: annotations},
		Spec: corev1.PodSpec{InitContainers: []corev1.Container{proxy}}}, nil
}

// printSidecar prints a sidecar pod's rules: what the agent programs for
// it at CNI ADD.
func printSidecar(s sidecarArgs, ann annFlag, family string, nft, del bool, stdout, stderr io.Writer) int {
	fail := func(err error) int {
		fmt.Fprintf(stderr, "ambientd rules --sidecar: %v\n", err)
		return 2
	}
	if del {
		return fail(fmt.Errorf("--delete: a sidecar pod's rules go with its sandbox; the agent removes them only to repair"))
	}
	pod, err := s.sidecarPod(ann)
	if err != nil {
		return fail(err)
	}
	if d := policy.DefaultConfig().Decide(pod, nil); !d.Sidecar {
		reason := d.SidecarSkip
		if reason == "" {
			reason = string(d.Reason)
		}
		fmt.Fprintf(stdout, "# not a sidecar pod the agent captures: %s\n", reason)
		return 0
	}
	var ips []netip.Addr
	for _, a := range s.ips {
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return fail(fmt.Errorf("--pod-ip %q: %w", a, err))
		}
		ips = append(ips, ip)
	}
	if len(ips) == 0 {
		ips = podmeta.IPs(pod)
	}
	if len(ips) == 0 {
		ips = []netip.Addr{netip.MustParseAddr("10.0.0.1")} // an IPv4 pod
	}
	p, err := sidecar.Parse(pod, ips)
	if err != nil {
		return fail(err)
	}
	o := p.Options
	for _, w := range p.Warnings {
		fmt.Fprintln(stdout, "# warning: "+w)
	}
	fmt.Fprintf(stdout, "# sidecar pod: %s\n", o.Key())
	if nft {
		fmt.Fprint(stdout, iptables.BuildSidecarRulesNFT(o).Render())
		for _, l := range sidecarNotes(o) {
			fmt.Fprintln(stdout, "# "+l)
		}
		return 0
	}
	rs := iptables.BuildSidecarRules(o)
	fams := rs.Families()
	switch family {
	case "4":
		fams = fams[:1]
	case "6":
		if !o.IPv6 {
			fmt.Fprintln(stdout, "# no IPv6 rules: the pod's IPv6 is not captured (no IPv6 address first, or no ISTIO_DUAL_STACK)")
			return 0
		}
		fams = fams[1:]
	case "", "all":
	default:
		return fail(fmt.Errorf("--family %q: want 4, 6 or all", family))
	}
	for i, f := range fams {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		fmt.Fprintf(stdout, "# %s-restore --noflush --wait\n", f)
		fmt.Fprint(stdout, rs.RenderApply(f))
	}
	for _, l := range sidecarNotes(o) {
		fmt.Fprintln(stdout, "# "+l)
	}
	return 0
}

// sidecarNotes describe the netlink part of a sidecar pod's capture.
func sidecarNotes(o iptables.SidecarOptions) []string {
	var out []string
	if o.IPv6 {
		out = append(out, "also, via netlink inside the pod: ip -6 addr add ::6/128 dev lo")
	}
	if o.TProxy() && o.InboundCaptured() {
		for _, f := range o.Families() {
			ip, dst := "ip", "0.0.0.0/0"
			if f == iptables.IPv6 {
				ip, dst = "ip -6", "::/0"
			}
			out = append(out, fmt.Sprintf("and: %s rule add fwmark %#x lookup %d; %s route add local %s dev lo table %d",
				ip, iptables.SidecarTProxyMark, iptables.SidecarTProxyTable, ip, dst, iptables.SidecarTProxyTable))
		}
	}
	return out
}
