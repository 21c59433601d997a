// Package kube is the node agent's Kubernetes API client: typed clients for
// the few resources the agent reads and writes (pods and their status,
// namespaces, nodes and their status, core/v1 Events, its own DaemonSet,
// RuntimeClasses and, for `ambientd check`, its ConfigMap),
// shared informers over them and an Event sink — built from client-go's
// generic pieces (rest, gentype, tools/cache, listers, tools/record) over a
// scheme that registers only the groups of those resources.
//
// Why not client-go's Clientset: k8s.io/client-go/kubernetes links a typed
// client, apply configurations and, through kubernetes/scheme, the API types
// of every group Kubernetes serves (their init registers them all); its
// informers and listers packages do the same. In the agent binary that was
// about 20 MB of code and tables and most of the executable pages it kept
// resident (docs/scale.md, "Lean binary").
//
// The interfaces here are subsets of client-go's typed interfaces with the
// same method signatures, so any kubernetes.Interface (the fake clientset in
// unit tests) fits through a few lines of adapter (test/infra/kubetest).
// This package, and everything the agent binary links, must not import
// k8s.io/client-go/kubernetes, informers, the typed listers,
// applyconfigurations or tools/events (nodeagent/imports_test.go).
package kube

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/gentype"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// Interface is the API the agent uses, shaped like client-go's
// kubernetes.Interface (client.CoreV1().Pods(ns).Get(...)).
type Interface interface {
	CoreV1() CoreV1Interface
	AppsV1() AppsV1Interface
	AdmissionregistrationV1() AdmissionregistrationV1Interface
	NodeV1() NodeV1Interface
}

// CoreV1Interface holds the core/v1 resources the agent uses.
type CoreV1Interface interface {
	Pods(namespace string) PodInterface
	Namespaces() NamespaceInterface
	Nodes() NodeInterface
	Events(namespace string) EventInterface
	ConfigMaps(namespace string) ConfigMapInterface
}

// AppsV1Interface holds the apps/v1 resources the agent uses.
type AppsV1Interface interface {
	DaemonSets(namespace string) DaemonSetInterface
}

// NodeV1Interface holds the node.k8s.io/v1 resources the agent uses.
type NodeV1Interface interface {
	RuntimeClasses() RuntimeClassInterface
}

// RuntimeClassInterface: RuntimeClasses are watched and read (the handler
// a pod's runtimeClassName names says whether the in-pod rules can capture
// its traffic).
type RuntimeClassInterface interface {
	Getter[*nodev1.RuntimeClass]
	ListWatcher[*nodev1.RuntimeClassList]
}

// AdmissionregistrationV1Interface holds what `ambientd check` reads to
// tell whether deploy/'s admission policies act: the policies and their
// bindings, and the readiness-gate webhook's configuration (read only).
type AdmissionregistrationV1Interface interface {
	MutatingWebhookConfigurations() Getter[*admissionregistrationv1.MutatingWebhookConfiguration]
	MutatingAdmissionPolicies() Getter[*admissionregistrationv1.MutatingAdmissionPolicy]
	MutatingAdmissionPolicyBindings() Lister[*admissionregistrationv1.MutatingAdmissionPolicyBindingList]
	ValidatingAdmissionPolicies() Getter[*admissionregistrationv1.ValidatingAdmissionPolicy]
	ValidatingAdmissionPolicyBindings() Lister[*admissionregistrationv1.ValidatingAdmissionPolicyBindingList]
}

// Getter, Lister, ListWatcher and Patcher are the verbs, with client-go's
// signatures.
type (
	Getter[T runtime.Object] interface {
		Get(ctx context.Context, name string, opts metav1.GetOptions) (T, error)
	}
	Lister[L runtime.Object] interface {
		List(ctx context.Context, opts metav1.ListOptions) (L, error)
	}
	ListWatcher[L runtime.Object] interface {
		List(ctx context.Context, opts metav1.ListOptions) (L, error)
		Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
	}
	Patcher[T runtime.Object] interface {
		Patch(ctx context.Context, name string, pt types.PatchType, data []byte, opts metav1.PatchOptions, subresources ...string) (T, error)
	}
)

// PodInterface: pods are looked up (CNI ADD, restart), watched (this
// node's) and their status patched (annotation and condition); the sidecar
// repair controller's delete mode deletes a broken pod.
type PodInterface interface {
	Getter[*corev1.Pod]
	ListWatcher[*corev1.PodList]
	Patcher[*corev1.Pod]
	Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error
}

// NamespaceInterface: namespaces are watched (their labels enroll pods)
// and read (a namespace not in the cache yet; the uninstall rule).
type NamespaceInterface interface {
	Getter[*corev1.Namespace]
	ListWatcher[*corev1.NamespaceList]
}

// NodeInterface: the agent's own node is watched and read, and its
// condition (status) and startup taint patched.
type NodeInterface interface {
	Getter[*corev1.Node]
	ListWatcher[*corev1.NodeList]
	Patcher[*corev1.Node]
}

// EventInterface is what client-go's Event recorder writes through (see
// EventSink); `ambientd bundle` lists the node's Events.
type EventInterface interface {
	Lister[*corev1.EventList]
	Create(ctx context.Context, event *corev1.Event, opts metav1.CreateOptions) (*corev1.Event, error)
	Update(ctx context.Context, event *corev1.Event, opts metav1.UpdateOptions) (*corev1.Event, error)
	Patcher[*corev1.Event]
}

// ConfigMapInterface: `ambientd check` reads the agent's ConfigMap (the
// settings admission and the agent share).
type ConfigMapInterface interface {
	Getter[*corev1.ConfigMap]
}

// DaemonSetInterface: the agent reads and watches its own DaemonSet (the
// uninstall rule, shutdownrule.Rule).
type DaemonSetInterface interface {
	Getter[*appsv1.DaemonSet]
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// NewScheme returns a scheme with the API groups the agent uses (core/v1,
// apps/v1, node.k8s.io/v1; admissionregistration/v1 for `ambientd check`) and the meta/v1 options its requests carry: what client-go's
// kubernetes/scheme does for every group.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	metav1.AddToGroupVersion(s, schema.GroupVersion{Version: "v1"})
	utilruntime.Must(corev1.AddToScheme(s))
	utilruntime.Must(appsv1.AddToScheme(s))
	utilruntime.Must(admissionregistrationv1.AddToScheme(s))
	utilruntime.Must(nodev1.AddToScheme(s))
	return s
}

// Client is the Interface over the API server. Its two REST clients (core
// and apps) share one HTTP client and one rate limiter, as a client-go
// Clientset's groups do.
type Client struct {
	core coreV1
	apps appsV1
	adm  admissionregistrationV1
	node nodeV1
}

var _ Interface = (*Client)(nil)

// NewForConfig returns a Client for c, as kubernetes.NewForConfig does:
// the default user agent when c has none, and a token-bucket rate limiter
// of c.QPS and c.Burst shared by all requests when c has none.
func NewForConfig(c *rest.Config) (*Client, error) {
	cfg := *c
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	if cfg.RateLimiter == nil && cfg.QPS > 0 {
		if cfg.Burst <= 0 {
			return nil, errors.New("kube: burst must be greater than 0 when QPS is set")
		}
		cfg.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(cfg.QPS, cfg.Burst)
	}
	httpClient, err := rest.HTTPClientFor(&cfg)
	if err != nil {
		return nil, fmt.Errorf("kube: HTTP client: %w", err)
	}
	scheme := NewScheme()
	codecs := serializer.NewCodecFactory(scheme)
	params := runtime.NewParameterCodec(scheme)
	core, err := restClient(cfg, httpClient, corev1.SchemeGroupVersion, "/api", scheme, codecs)
	if err != nil {
		return nil, err
	}
	apps, err := restClient(cfg, httpClient, appsv1.SchemeGroupVersion, "/apis", scheme, codecs)
	if err != nil {
		return nil, err
	}
	adm, err := restClient(cfg, httpClient, admissionregistrationv1.SchemeGroupVersion, "/apis", scheme, codecs)
	if err != nil {
		return nil, err
	}
	node, err := restClient(cfg, httpClient, nodev1.SchemeGroupVersion, "/apis", scheme, codecs)
	if err != nil {
		return nil, err
	}
	return &Client{core: coreV1{core, params}, apps: appsV1{apps, params}, adm: admissionregistrationV1{adm, params}, node: nodeV1{node, params}}, nil
}

// restClient is one group version's REST client, configured as client-go's
// generated clients configure theirs.
func restClient(cfg rest.Config, h *http.Client, gv schema.GroupVersion, apiPath string, scheme *runtime.Scheme, codecs serializer.CodecFactory) (*rest.RESTClient, error) {
	cfg.GroupVersion = &gv
	cfg.APIPath = apiPath
	cfg.NegotiatedSerializer = rest.CodecFactoryForGeneratedClient(scheme, codecs).WithoutConversion()
	rc, err := rest.RESTClientForConfigAndClient(&cfg, h)
	if err != nil {
		return nil, fmt.Errorf("kube: %s client: %w", gv, err)
	}
	return rc, nil
}

// Object reads one cluster-scoped object of any API group as JSON, by its
// group, version and resource: `ambientd check --cluster-breakers` reads
// other projects' custom resources (Calico's FelixConfiguration) without
// their Go types and without client-go's dynamic client, which the agent
// binary does not link (lean binary). API errors are *apierrors.StatusError,
// as the typed clients return them.
func (c *Client) Object(ctx context.Context, gvr schema.GroupVersionResource, name string) (*unstructured.Unstructured, error) {
	if gvr.Group == "" || gvr.Version == "" || gvr.Resource == "" || name == "" {
		return nil, fmt.Errorf("kube: object %s %q: group, version, resource and name are required", gvr, name)
	}
	raw, err := c.adm.rc.Get().AbsPath("/apis", gvr.Group, gvr.Version, gvr.Resource, name).
		SetHeader("Accept", "application/json").Do(ctx).Raw()
	if err != nil {
		return nil, err
	}
	var o unstructured.Unstructured
	if err := o.UnmarshalJSON(raw); err != nil {
		return nil, fmt.Errorf("kube: %s %s: %w", gvr, name, err)
	}
	return &o, nil
}

// CoreV1 returns the core/v1 clients.
func (c *Client) CoreV1() CoreV1Interface { return c.core }

// AppsV1 returns the apps/v1 clients.
func (c *Client) AppsV1() AppsV1Interface { return c.apps }

// AdmissionregistrationV1 returns the admissionregistration/v1 clients.
func (c *Client) AdmissionregistrationV1() AdmissionregistrationV1Interface { return c.adm }

// NodeV1 returns the node.k8s.io/v1 clients.
func (c *Client) NodeV1() NodeV1Interface { return c.node }

type coreV1 struct {
	rc     rest.Interface
	params runtime.ParameterCodec
}

// The typed clients are client-go's generic ones (gentype), with the
// resource names and the protobuf preference of its generated clients.
// Events are sent as JSON, as client-go's Event sink sends them.

func (c coreV1) Pods(namespace string) PodInterface {
	return gentype.NewClientWithList("pods", c.rc, c.params, namespace,
		func() *corev1.Pod { return &corev1.Pod{} }, func() *corev1.PodList { return &corev1.PodList{} },
		gentype.PrefersProtobuf[*corev1.Pod]())
}

func (c coreV1) Namespaces() NamespaceInterface {
	return gentype.NewClientWithList("namespaces", c.rc, c.params, "",
		func() *corev1.Namespace { return &corev1.Namespace{} }, func() *corev1.NamespaceList { return &corev1.NamespaceList{} },
		gentype.PrefersProtobuf[*corev1.Namespace]())
}

func (c coreV1) Nodes() NodeInterface {
	return gentype.NewClientWithList("nodes", c.rc, c.params, "",
		func() *corev1.Node { return &corev1.Node{} }, func() *corev1.NodeList { return &corev1.NodeList{} },
		gentype.PrefersProtobuf[*corev1.Node]())
}

func (c coreV1) Events(namespace string) EventInterface {
	return gentype.NewClientWithList("events", c.rc, c.params, namespace,
		func() *corev1.Event { return &corev1.Event{} }, func() *corev1.EventList { return &corev1.EventList{} })
}

func (c coreV1) ConfigMaps(namespace string) ConfigMapInterface {
	return gentype.NewClient("configmaps", c.rc, c.params, namespace,
		func() *corev1.ConfigMap { return &corev1.ConfigMap{} },
		gentype.PrefersProtobuf[*corev1.ConfigMap]())
}

type appsV1 struct {
	rc     rest.Interface
	params runtime.ParameterCodec
}

func (c appsV1) DaemonSets(namespace string) DaemonSetInterface {
	return gentype.NewClient("daemonsets", c.rc, c.params, namespace,
		func() *appsv1.DaemonSet { return &appsv1.DaemonSet{} },
		gentype.PrefersProtobuf[*appsv1.DaemonSet]())
}

type admissionregistrationV1 struct {
	rc     rest.Interface
	params runtime.ParameterCodec
}

func (c admissionregistrationV1) MutatingWebhookConfigurations() Getter[*admissionregistrationv1.MutatingWebhookConfiguration] {
	return c.webhookConfigurations()
}

func (c admissionregistrationV1) webhookConfigurations() WebhookConfigurationInterface {
	return gentype.NewClient("mutatingwebhookconfigurations", c.rc, c.params, "",
		func() *admissionregistrationv1.MutatingWebhookConfiguration {
			return &admissionregistrationv1.MutatingWebhookConfiguration{}
		},
		gentype.PrefersProtobuf[*admissionregistrationv1.MutatingWebhookConfiguration]())
}

func (c admissionregistrationV1) MutatingAdmissionPolicies() Getter[*admissionregistrationv1.MutatingAdmissionPolicy] {
	return gentype.NewClient("mutatingadmissionpolicies", c.rc, c.params, "",
		func() *admissionregistrationv1.MutatingAdmissionPolicy {
			return &admissionregistrationv1.MutatingAdmissionPolicy{}
		},
		gentype.PrefersProtobuf[*admissionregistrationv1.MutatingAdmissionPolicy]())
}

func (c admissionregistrationV1) MutatingAdmissionPolicyBindings() Lister[*admissionregistrationv1.MutatingAdmissionPolicyBindingList] {
	return gentype.NewClientWithList("mutatingadmissionpolicybindings", c.rc, c.params, "",
		func() *admissionregistrationv1.MutatingAdmissionPolicyBinding {
			return &admissionregistrationv1.MutatingAdmissionPolicyBinding{}
		},
		func() *admissionregistrationv1.MutatingAdmissionPolicyBindingList {
			return &admissionregistrationv1.MutatingAdmissionPolicyBindingList{}
		},
		gentype.PrefersProtobuf[*admissionregistrationv1.MutatingAdmissionPolicyBinding]())
}

func (c admissionregistrationV1) ValidatingAdmissionPolicies() Getter[*admissionregistrationv1.ValidatingAdmissionPolicy] {
	return gentype.NewClient("validatingadmissionpolicies", c.rc, c.params, "",
		func() *admissionregistrationv1.ValidatingAdmissionPolicy {
			return &admissionregistrationv1.ValidatingAdmissionPolicy{}
		},
		gentype.PrefersProtobuf[*admissionregistrationv1.ValidatingAdmissionPolicy]())
}

func (c admissionregistrationV1) ValidatingAdmissionPolicyBindings() Lister[*admissionregistrationv1.ValidatingAdmissionPolicyBindingList] {
	return gentype.NewClientWithList("validatingadmissionpolicybindings", c.rc, c.params, "",
		func() *admissionregistrationv1.ValidatingAdmissionPolicyBinding {
			return &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
		},
		func() *admissionregistrationv1.ValidatingAdmissionPolicyBindingList {
			return &admissionregistrationv1.ValidatingAdmissionPolicyBindingList{}
		},
		gentype.PrefersProtobuf[*admissionregistrationv1.ValidatingAdmissionPolicyBinding]())
}

type nodeV1 struct {
	rc     rest.Interface
	params runtime.ParameterCodec
}

func (c nodeV1) RuntimeClasses() RuntimeClassInterface {
	return gentype.NewClientWithList("runtimeclasses", c.rc, c.params, "",
		func() *nodev1.RuntimeClass { return &nodev1.RuntimeClass{} }, func() *nodev1.RuntimeClassList { return &nodev1.RuntimeClassList{} },
		gentype.PrefersProtobuf[*nodev1.RuntimeClass]())
}
