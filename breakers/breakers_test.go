package breakers

import (
	"bytes"
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/test/infra/kubetest"
)

// objects is a map of FelixConfigurations by API version; absent ones are
// NotFound, forbidden ones Forbidden.
type objects struct {
	byVersion map[string]map[string]any
	forbidden bool
}

func (o objects) Object(_ context.Context, gvr schema.GroupVersionResource, name string) (*unstructured.Unstructured, error) {
	gr := gvr.GroupResource()
	if o.forbidden {
		return nil, apierrors.NewForbidden(gr, name, nil)
	}
	spec, ok := o.byVersion[gvr.GroupVersion().String()]
	if !ok {
		return nil, apierrors.NewNotFound(gr, name)
	}
	return &unstructured.Unstructured{Object: map[string]any{"metadata": map[string]any{"name": name}, "spec": spec}}, nil
}

func configMap(ns, name string, data map[string]string) *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Data: data}
}

// TestFind: each setting istioctl warns of is named as a breaker with its
// fix, harmless settings are reported as facts, and absent objects are
// notes.
func TestFind(t *testing.T) {
	crd := "crd.projectcalico.org/v1"
	tests := []struct {
		name      string
		cilium    map[string]string // nil: no ConfigMap
		felix     map[string]map[string]any
		kubeProxy map[string]string
		want      []string // settings found as breakers
		facts     []string // settings found as facts
		notes     []string // substrings of notes
	}{
		{name: "nothing installed", notes: []string{"cilium-config (Cilium): not found", "FelixConfiguration default (Calico): none read (projectcalico.org/v3: not found; crd.projectcalico.org/v1: not found)", "kube-proxy (kube-proxy): not found"}},
		{name: "cilium exclusive", cilium: map[string]string{"cni-exclusive": "true"}, want: []string{"cni-exclusive=true"}},
		{name: "cilium socket lb in pods", cilium: map[string]string{"bpf-lb-sock": "true"}, want: []string{"bpf-lb-sock=true without bpf-lb-sock-hostns-only=true"}},
		{name: "cilium socket lb host only", cilium: map[string]string{"bpf-lb-sock": "true", "bpf-lb-sock-hostns-only": "true", "cni-exclusive": "false"},
			facts: []string{"cni-exclusive=false bpf-lb-sock=true bpf-lb-sock-hostns-only=true enable-bpf-masquerade=(unset)"}},
		{name: "cilium strict kpr", cilium: map[string]string{"kube-proxy-replacement": "strict"}, want: []string{"kube-proxy-replacement=strict without bpf-lb-sock-hostns-only=true"}},
		{name: "cilium bpf masquerade", cilium: map[string]string{"enable-bpf-masquerade": "true"}, want: []string{"enable-bpf-masquerade=true"}},
		{name: "cilium all", cilium: map[string]string{"cni-exclusive": "true", "bpf-lb-sock": "true", "enable-bpf-masquerade": "true"},
			want: []string{"cni-exclusive=true", "bpf-lb-sock=true without bpf-lb-sock-hostns-only=true", "enable-bpf-masquerade=true"}},
		{name: "calico ctlb TCP", felix: map[string]map[string]any{crd: {"bpfConnectTimeLoadBalancing": "TCP"}}, want: []string{"bpfConnectTimeLoadBalancing=TCP"}},
		{name: "calico ctlb legacy bool", felix: map[string]map[string]any{crd: {"bpfConnectTimeLoadBalancingEnabled": true}}, want: []string{"bpfConnectTimeLoadBalancingEnabled=true"}},
		{name: "calico ctlb disabled", felix: map[string]map[string]any{crd: {"bpfConnectTimeLoadBalancing": "Disabled", "bpfConnectTimeLoadBalancingEnabled": false}},
			facts: []string{"bpfConnectTimeLoadBalancing=Disabled"}},
		{name: "calico API server wins", felix: map[string]map[string]any{"projectcalico.org/v3": {"bpfConnectTimeLoadBalancing": "Enabled"}, crd: {"bpfConnectTimeLoadBalancing": "Disabled"}},
			want: []string{"bpfConnectTimeLoadBalancing=Enabled"}},
		{name: "kube-proxy ipvs", kubeProxy: map[string]string{"config.conf": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n"}, facts: []string{"mode=ipvs"}},
		{name: "kube-proxy default mode", kubeProxy: map[string]string{"config.conf": "kind: KubeProxyConfiguration\nmode: \"\"\n"}, facts: []string{"mode=iptables"}},
		{name: "kube-proxy without config", kubeProxy: map[string]string{"kubeconfig.conf": "x"}, notes: []string{"no config.conf key"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var objs []runtime.Object
			if tt.cilium != nil {
				objs = append(objs, configMap(CiliumNamespace, CiliumConfigMap, tt.cilium))
			}
			if tt.kubeProxy != nil {
				objs = append(objs, configMap(KubeProxyNamespace, KubeProxyConfigMap, tt.kubeProxy))
			}
			r := Find(t.Context(), kubetest.Wrap(fake.NewClientset(objs...)), objects{byVersion: tt.felix})
			var got, facts []string
			for _, f := range r.Findings {
				if f.Breaker {
					got = append(got, f.Setting)
					if f.Fix == "" || f.Problem == "" {
						t.Errorf("%s: breaker without problem or fix: %+v", f.Setting, f)
					}
					// The fix patches the API the setting was read from.
					if group, ok := strings.CutSuffix(strings.TrimPrefix(f.Source, "FelixConfiguration default ("), ")"); f.Component == "Calico" && (!ok || !strings.Contains(f.Fix, "kubectl patch felixconfigurations."+strings.Split(group, "/")[0]+" default")) {
						t.Errorf("%s: fix %q does not patch the API it was read from (%s)", f.Setting, f.Fix, f.Source)
					}
				} else {
					facts = append(facts, f.Setting)
				}
			}
			if strings.Join(got, "|") != strings.Join(tt.want, "|") {
				t.Errorf("breakers %q, want %q", got, tt.want)
			}
			for _, want := range tt.facts {
				if !strings.Contains(strings.Join(facts, "|"), want) {
					t.Errorf("facts %q, want %q among them", facts, want)
				}
			}
			for _, want := range tt.notes {
				if !strings.Contains(strings.Join(r.Notes, "\n"), want) {
					t.Errorf("notes %q, want %q among them", r.Notes, want)
				}
			}
			if r.Breakers() != len(tt.want) {
				t.Errorf("Breakers() = %d, want %d", r.Breakers(), len(tt.want))
			}
		})
	}
}

// TestFindWithoutRights: a user who may read nothing gets notes saying
// so for each object, and no finding.
func TestFindWithoutRights(t *testing.T) {
	cs := fake.NewClientset(configMap(CiliumNamespace, CiliumConfigMap, map[string]string{"cni-exclusive": "true"}))
	cs.PrependReactor("get", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, a.(k8stesting.GetAction).GetName(), nil)
	})
	r := Find(t.Context(), kubetest.Wrap(cs), objects{forbidden: true})
	if len(r.Findings) != 0 || len(r.Notes) != 3 {
		t.Fatalf("findings %+v notes %q; want none and three notes", r.Findings, r.Notes)
	}
	for _, n := range r.Notes {
		if !strings.Contains(n, "Forbidden") {
			t.Errorf("note %q does not say the read was forbidden", n)
		}
	}
	var b bytes.Buffer
	if err := WriteTable(&b, r); err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(b.String(), "no known breaker of ambient capture found\n") || strings.Count(b.String(), "note: ") != 3 {
		t.Errorf("table:\n%s", b.String())
	}
}
