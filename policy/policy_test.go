package policy

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
)

func TestDecide(t *testing.T) {
	ambient := map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
	none := map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeNone}
	pod := func(ns string, labels, ann map[string]string, mut ...func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns, Labels: labels, Annotations: ann}}
		for _, m := range mut {
			m(p)
		}
		return p
	}
	hostNet := func(p *corev1.Pod) { p.Spec.HostNetwork = true }
	const noProxy = "excluded because it does not have istio-proxy container (have [])"
	phase := func(ph corev1.PodPhase) func(*corev1.Pod) { return func(p *corev1.Pod) { p.Status.Phase = ph } }

	tests := []struct {
		name     string
		pod      *corev1.Pod
		nsLabels map[string]string
		want     Decision
	}{
		{"namespace labelled", pod("a", nil, nil), ambient, Decision{InMesh: true, Reason: ReasonNamespaceLabel}},
		{"pod labelled", pod("a", ambient, nil), nil, Decision{InMesh: true, Reason: ReasonPodLabel}},
		{"nothing labelled", pod("a", nil, nil), nil, Decision{InMesh: false, Reason: ReasonNotLabelled}},
		{"other namespace mode", pod("a", nil, nil), map[string]string{podmeta.LabelDataplaneMode: "sidecar"}, Decision{InMesh: false, Reason: ReasonNotLabelled}},
		{"pod opts out of ambient namespace", pod("a", none, nil), ambient, Decision{InMesh: false, Reason: ReasonPodOptOut}},
		{"excluded namespace beats pod label", pod("kube-system", ambient, nil), ambient, Decision{InMesh: false, Reason: ReasonExcludedNamespace}},
		{"host network", pod("a", ambient, nil, hostNet), ambient, Decision{InMesh: false, Reason: ReasonHostNetwork}},
		{"sidecar injected", pod("a", nil, map[string]string{podmeta.AnnotationSidecarStatus: "{}"}), ambient, Decision{Reason: ReasonSidecar, SidecarSkip: noProxy}},
		{"sidecar annotation empty still counts", pod("a", nil, map[string]string{podmeta.AnnotationSidecarStatus: ""}), ambient, Decision{Reason: ReasonSidecar, SidecarSkip: noProxy}},
		{"ztunnel pod", pod("istio-system", map[string]string{"app": "ztunnel"}, nil), ambient, Decision{InMesh: false, Reason: ReasonZtunnel}},
		{"agent pod", pod("istio-system", map[string]string{"app": "ambientd", podmeta.LabelDataplaneMode: podmeta.ModeAmbient}, nil), ambient, Decision{InMesh: false, Reason: ReasonSelf}},
		// Istio scopes the mesh's own pods to the system namespace: a
		// user's app=ztunnel elsewhere is an ordinary pod.
		{"app=ztunnel outside the system namespace", pod("shop", map[string]string{"app": "ztunnel"}, nil), ambient, Decision{InMesh: true, Reason: ReasonNamespaceLabel}},
		{"app=ambientd outside the system namespace", pod("shop", map[string]string{"app": "ambientd", podmeta.LabelDataplaneMode: podmeta.ModeAmbient}, nil), nil, Decision{InMesh: true, Reason: ReasonPodLabel}},
		{"succeeded pod", pod("a", nil, nil, phase(corev1.PodSucceeded)), ambient, Decision{InMesh: false, Reason: ReasonTerminal}},
		{"failed pod", pod("a", nil, nil, phase(corev1.PodFailed)), ambient, Decision{InMesh: false, Reason: ReasonTerminal}},
		{"running pod", pod("a", nil, nil, phase(corev1.PodRunning)), ambient, Decision{InMesh: true, Reason: ReasonNamespaceLabel}},
	}
	cfg := DefaultConfig()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := cfg.Decide(tt.pod, tt.nsLabels); got != tt.want {
				t.Errorf("Decide = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestDecideEmptyConfigExcludesNothing(t *testing.T) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Labels: map[string]string{"app": "ztunnel"}}}
	got := Config{}.Decide(p, map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient})
	if !got.InMesh {
		t.Errorf("empty config: Decide = %+v, want in mesh", got)
	}
}

func TestDecideSystemNamespaceSetting(t *testing.T) {
	ambient := map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
	zt := func(ns string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Labels: map[string]string{"app": "ztunnel"}}}
	}
	cfg := DefaultConfig()
	cfg.SystemNamespace = "mesh-system"
	if got := cfg.Decide(zt("mesh-system"), ambient); got != (Decision{InMesh: false, Reason: ReasonZtunnel}) {
		t.Errorf("ztunnel in the configured system namespace: %+v", got)
	}
	if got := cfg.Decide(zt("istio-system"), ambient); got != (Decision{InMesh: true, Reason: ReasonNamespaceLabel}) {
		t.Errorf("app=ztunnel in istio-system when the system namespace is mesh-system: %+v", got)
	}
	cfg.SystemNamespace = ""
	if got := cfg.Decide(zt("istio-system"), ambient); !got.InMesh {
		t.Errorf("no system namespace: %+v, want in mesh", got)
	}
}
