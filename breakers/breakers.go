// Package breakers names the cluster settings under which ambient capture
// silently fails — the ones `istioctl install` warns of (Istio's
// operator/pkg/apis/validation/validation.go, detectCniIncompatibility) —
// with the fix for each: Cilium's exclusive CNI config and its eBPF socket
// load balancing and masquerading, Calico's eBPF connect-time load
// balancing. It also reports kube-proxy's mode as a fact. It reads through
// the API only (`ambientd check --cluster-breakers`); whatever is absent or
// may not be read becomes a note, never a failure.
package breakers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/nodeagent/kube"
)

// Where the settings are read.
const (
	CiliumNamespace    = "kube-system"
	CiliumConfigMap    = "cilium-config"
	KubeProxyNamespace = "kube-system"
	KubeProxyConfigMap = "kube-proxy"
	// FelixConfigurationName is Calico's cluster-wide Felix configuration.
	FelixConfigurationName = "default"
)

// FelixConfigurations are the two APIs Calico serves its Felix
// configuration under, in the order they are tried: projectcalico.org/v3
// (the Calico API server; what istioctl reads) and crd.projectcalico.org/v1
// (the CRD behind it, present on every Calico install). Same spec fields.
var FelixConfigurations = []schema.GroupVersionResource{
	{Group: "projectcalico.org", Version: "v3", Resource: "felixconfigurations"},
	{Group: "crd.projectcalico.org", Version: "v1", Resource: "felixconfigurations"},
}

// Objects reads one cluster-scoped object of any API group
// (kube.Client.Object).
type Objects interface {
	Object(ctx context.Context, gvr schema.GroupVersionResource, name string) (*unstructured.Unstructured, error)
}

// Finding is one setting read. Breaker marks a setting under which
// capture fails; the others are facts worth knowing.
type Finding struct {
	Component string `json:"component"` // Cilium, Calico, kube-proxy
	Source    string `json:"source"`    // e.g. ConfigMap kube-system/cilium-config
	Setting   string `json:"setting"`   // e.g. cni-exclusive=true
	Breaker   bool   `json:"breaker"`
	Problem   string `json:"problem"`
	Fix       string `json:"fix,omitempty"`
}

// Report is what Find found; it is the -o json output.
type Report struct {
	Findings []Finding `json:"findings"`
	Notes    []string  `json:"notes,omitempty"`
}

// Breakers counts the findings that break capture.
func (r Report) Breakers() int {
	n := 0
	for _, f := range r.Findings {
		if f.Breaker {
			n++
		}
	}
	return n
}

// Find reads Cilium's ConfigMap, Calico's FelixConfiguration and
// kube-proxy's ConfigMap and names each breaker. Absent objects and
// missing rights are notes.
func Find(ctx context.Context, client kube.Interface, objects Objects) Report {
	var r Report
	r.cilium(ctx, client)
	r.calico(ctx, objects)
	r.kubeProxy(ctx, client)
	return r
}

func (r *Report) note(format string, args ...any) {
	r.Notes = append(r.Notes, fmt.Sprintf(format, args...))
}

// unread notes why an object could not be read.
func (r *Report) unread(what string, err error) {
	switch {
	case apierrors.IsNotFound(err):
		r.note("%s: not found", what)
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		r.note("%s: may not be read (%s): its settings are unknown", what, short(err))
	default:
		r.note("%s: cannot be read (%s): its settings are unknown", what, short(err))
	}
}

// short is an API error without the request details.
func short(err error) string {
	var se *apierrors.StatusError
	if errors.As(err, &se) {
		return string(se.ErrStatus.Reason)
	}
	return err.Error()
}

func (r *Report) cilium(ctx context.Context, client kube.Interface) {
	src := "ConfigMap " + CiliumNamespace + "/" + CiliumConfigMap
	cm, err := client.CoreV1().ConfigMaps(CiliumNamespace).Get(ctx, CiliumConfigMap, metav1.GetOptions{})
	if err != nil {
		r.unread(src+" (Cilium)", err)
		return
	}
	before := len(r.Findings)
	add := func(setting, problem, fix string) {
		r.Findings = append(r.Findings, Finding{Component: "Cilium", Source: src, Setting: setting, Breaker: true, Problem: problem, Fix: fix})
	}
	// Unset means false for each key, as istioctl reads them.
	on := func(k string) bool { return cm.Data[k] == "true" }
	if on("cni-exclusive") {
		add("cni-exclusive=true",
			"Cilium renames every other CNI config in the conf dir (ambientd's 00-ambientd.conflist included) to *.cilium_bak and rewrites its own at every change there: pods whose sandbox starts before the agent puts its config back run without ambientd's plugin and are not captured",
			`set cni.exclusive=false in Cilium's Helm values (cilium-config: cni-exclusive: "false") and restart the cilium DaemonSet`)
	}
	if on("bpf-lb-sock") && !on("bpf-lb-sock-hostns-only") {
		add("bpf-lb-sock=true without bpf-lb-sock-hostns-only=true",
			"Cilium's eBPF socket load balancing rewrites a pod's connect() to a Service into the backend pod's address inside the pod, before the in-pod rules see it: ztunnel gets the pod address, not the Service, so Service-level policy and waypoints are bypassed",
			`set socketLB.hostNamespaceOnly=true in Cilium's Helm values (cilium-config: bpf-lb-sock-hostns-only: "true") and restart the cilium DaemonSet`)
	}
	if cm.Data["kube-proxy-replacement"] == "strict" && !on("bpf-lb-sock-hostns-only") {
		add("kube-proxy-replacement=strict without bpf-lb-sock-hostns-only=true",
			"Cilium before 1.16 with kube-proxy-replacement=strict load-balances at the socket in every namespace by default: the same bypass as bpf-lb-sock=true",
			`set socketLB.hostNamespaceOnly=true in Cilium's Helm values (cilium-config: bpf-lb-sock-hostns-only: "true") and restart the cilium DaemonSet`)
	}
	if on("enable-bpf-masquerade") {
		add("enable-bpf-masquerade=true",
			"Cilium's eBPF masquerading does not leave link-local traffic alone: kubelet's probes, which the agent SNATs to 169.254.7.127 so ztunnel lets them in, get no answer, and captured pods fail their probes",
			`set bpf.masquerade=false in Cilium's Helm values (cilium-config: enable-bpf-masquerade: "false"; Cilium's iptables masquerading works) and restart the cilium DaemonSet`)
	}
	if len(r.Findings) == before {
		r.Findings = append(r.Findings, Finding{Component: "Cilium", Source: src,
			Setting: fmt.Sprintf("cni-exclusive=%s bpf-lb-sock=%s bpf-lb-sock-hostns-only=%s enable-bpf-masquerade=%s",
				orUnset(cm.Data, "cni-exclusive"), orUnset(cm.Data, "bpf-lb-sock"), orUnset(cm.Data, "bpf-lb-sock-hostns-only"), orUnset(cm.Data, "enable-bpf-masquerade")),
			Problem: "none of the settings that break ambient capture"})
	}
}

func orUnset(m map[string]string, k string) string {
	if v, ok := m[k]; ok {
		return v
	}
	return "(unset)"
}

func (r *Report) calico(ctx context.Context, objects Objects) {
	var fc *unstructured.Unstructured
	var src, resource string
	var errs []string
	for _, gvr := range FelixConfigurations {
		o, err := objects.Object(ctx, gvr, FelixConfigurationName)
		if err == nil {
			fc, src, resource = o, "FelixConfiguration "+FelixConfigurationName+" ("+gvr.GroupVersion().String()+")", gvr.GroupResource().String()
			break
		}
		what := gvr.GroupVersion().String()
		switch {
		case apierrors.IsNotFound(err):
			what += ": not found"
		default:
			what += ": " + short(err)
		}
		errs = append(errs, what)
	}
	if fc == nil {
		r.note("FelixConfiguration %s (Calico): none read (%s)", FelixConfigurationName, strings.Join(errs, "; "))
		return
	}
	add := func(setting, fix string) {
		r.Findings = append(r.Findings, Finding{Component: "Calico", Source: src, Setting: setting, Breaker: true,
			Problem: "Calico's eBPF connect-time load balancing rewrites a pod's connect() to a Service into the backend pod's address inside the pod, before the in-pod rules see it: ztunnel gets the pod address, not the Service, so Service-level policy and waypoints are bypassed",
			Fix:     fix})
	}
	before := len(r.Findings)
	if v, found, _ := unstructured.NestedString(fc.Object, "spec", "bpfConnectTimeLoadBalancing"); found && v != "Disabled" {
		add("bpfConnectTimeLoadBalancing="+v,
			"kubectl patch "+resource+` default --type merge -p '{"spec":{"bpfConnectTimeLoadBalancing":"Disabled"}}' (Calico then load-balances Services at the host, after capture)`)
	}
	if v, found, _ := unstructured.NestedBool(fc.Object, "spec", "bpfConnectTimeLoadBalancingEnabled"); found && v {
		add("bpfConnectTimeLoadBalancingEnabled=true",
			"kubectl patch "+resource+` default --type merge -p '{"spec":{"bpfConnectTimeLoadBalancingEnabled":false}}'`)
	}
	if len(r.Findings) == before {
		v, found, _ := unstructured.NestedFieldNoCopy(fc.Object, "spec", "bpfConnectTimeLoadBalancing")
		setting := "bpfConnectTimeLoadBalancing=(unset)"
		if found {
			setting = fmt.Sprintf("bpfConnectTimeLoadBalancing=%v", v)
		}
		r.Findings = append(r.Findings, Finding{Component: "Calico", Source: src, Setting: setting,
			Problem: "none of the settings that break ambient capture"})
	}
}

// kubeProxyConfig is the part of kube-proxy's KubeProxyConfiguration read
// here (kubeadm writes it as config.conf in the kube-proxy ConfigMap).
type kubeProxyConfig struct {
	Mode string `json:"mode"`
}

func (r *Report) kubeProxy(ctx context.Context, client kube.Interface) {
	src := "ConfigMap " + KubeProxyNamespace + "/" + KubeProxyConfigMap
	cm, err := client.CoreV1().ConfigMaps(KubeProxyNamespace).Get(ctx, KubeProxyConfigMap, metav1.GetOptions{})
	if err != nil {
		r.unread(src+" (kube-proxy)", err)
		return
	}
	text, ok := cm.Data["config.conf"]
	if !ok {
		r.note("%s: no config.conf key: kube-proxy's mode is unknown", src)
		return
	}
	var c kubeProxyConfig
	if err := yaml.Unmarshal([]byte(text), &c); err != nil {
		r.note("%s: config.conf is not a KubeProxyConfiguration (%v): kube-proxy's mode is unknown", src, err)
		return
	}
	mode := c.Mode
	if mode == "" {
		mode = "iptables" // kube-proxy's default on Linux
	}
	r.Findings = append(r.Findings, Finding{Component: "kube-proxy", Source: src, Setting: "mode=" + mode,
		Problem: "not a breaker: capture happens in the pod's network namespace, before the host's Service rules (iptables, ipvs or nftables) see the packet"})
}

// WriteTable writes r for people: one block per finding, breakers first,
// then the notes and a count.
func WriteTable(w io.Writer, r Report) error {
	var b strings.Builder
	for _, pass := range []bool{true, false} {
		for _, f := range r.Findings {
			if f.Breaker != pass {
				continue
			}
			mark := "ok     "
			if f.Breaker {
				mark = "BREAKER"
			}
			fmt.Fprintf(&b, "%s %s: %s (%s)\n        %s\n", mark, f.Component, f.Setting, f.Source, f.Problem)
			if f.Fix != "" {
				fmt.Fprintf(&b, "        fix: %s\n", f.Fix)
			}
		}
	}
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	switch n := r.Breakers(); n {
	case 0:
		b.WriteString("no known breaker of ambient capture found\n")
	default:
		fmt.Fprintf(&b, "%d known breaker(s) of ambient capture found\n", n)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
