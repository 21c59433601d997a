// Package kubetest lets tests hand a client-go clientset — the fake one
// (k8s.io/client-go/kubernetes/fake) in unit tests, a real one in e2e
// tests — to code that takes the agent's narrow client, kube.Interface.
// client-go's typed clients have the methods kube's interfaces name, with
// the same signatures; only the getters in between need these few lines.
//
// Test code only: it imports the full clientset, which the agent binary
// must not link (nodeagent/imports_test.go).
package kubetest

import (
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/watchlist"

	"github.com/ambientd/ambientd/nodeagent/kube"
)

// Wrap returns cs as a kube.Interface.
func Wrap(cs kubernetes.Interface) kube.Interface { return clientset{cs} }

type clientset struct{ cs kubernetes.Interface }

func (c clientset) CoreV1() kube.CoreV1Interface { return coreV1(c) }
func (c clientset) AppsV1() kube.AppsV1Interface { return appsV1(c) }
func (c clientset) AdmissionregistrationV1() kube.AdmissionregistrationV1Interface {
	return admissionregistrationV1(c)
}
func (c clientset) NodeV1() kube.NodeV1Interface { return nodeV1(c) }

// IsWatchListSemanticsUnSupported passes on what the clientset says (the
// fake has no watch-list support), so informers over the wrapper list and
// watch as client-go's own informers over cs do.
func (c clientset) IsWatchListSemanticsUnSupported() bool {
	return watchlist.DoesClientNotSupportWatchListSemantics(c.cs)
}

type coreV1 clientset

func (c coreV1) Pods(ns string) kube.PodInterface     { return c.cs.CoreV1().Pods(ns) }
func (c coreV1) Namespaces() kube.NamespaceInterface  { return c.cs.CoreV1().Namespaces() }
func (c coreV1) Nodes() kube.NodeInterface            { return c.cs.CoreV1().Nodes() }
func (c coreV1) Events(ns string) kube.EventInterface { return c.cs.CoreV1().Events(ns) }
func (c coreV1) ConfigMaps(ns string) kube.ConfigMapInterface {
	return c.cs.CoreV1().ConfigMaps(ns)
}

type appsV1 clientset

func (c appsV1) DaemonSets(ns string) kube.DaemonSetInterface { return c.cs.AppsV1().DaemonSets(ns) }

type nodeV1 clientset

func (c nodeV1) RuntimeClasses() kube.RuntimeClassInterface { return c.cs.NodeV1().RuntimeClasses() }

type admissionregistrationV1 clientset

func (c admissionregistrationV1) MutatingWebhookConfigurations() kube.Getter[*admissionregistrationv1.MutatingWebhookConfiguration] {
	return c.cs.AdmissionregistrationV1().MutatingWebhookConfigurations()
}

func (c admissionregistrationV1) MutatingAdmissionPolicies() kube.Getter[*admissionregistrationv1.MutatingAdmissionPolicy] {
	return c.cs.AdmissionregistrationV1().MutatingAdmissionPolicies()
}

func (c admissionregistrationV1) MutatingAdmissionPolicyBindings() kube.Lister[*admissionregistrationv1.MutatingAdmissionPolicyBindingList] {
	return c.cs.AdmissionregistrationV1().MutatingAdmissionPolicyBindings()
}

func (c admissionregistrationV1) ValidatingAdmissionPolicies() kube.Getter[*admissionregistrationv1.ValidatingAdmissionPolicy] {
	return c.cs.AdmissionregistrationV1().ValidatingAdmissionPolicies()
}

func (c admissionregistrationV1) ValidatingAdmissionPolicyBindings() kube.Lister[*admissionregistrationv1.ValidatingAdmissionPolicyBindingList] {
	return c.cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings()
}
