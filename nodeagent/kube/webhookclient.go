package kube

import (
	"context"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/gentype"
	"k8s.io/client-go/tools/cache"
)

// What `ambientd webhook` uses besides the agent's resources: its CA's
// Secret and its MutatingWebhookConfiguration (read and updated by name),
// and the agent's ConfigMap, watched by name. They are methods of Client,
// not of Interface: the agent never uses them.

// SecretInterface: the webhook's CA Secret is read, created when missing
// and updated (optimistic concurrency: the update carries the
// resourceVersion read).
type SecretInterface interface {
	Getter[*corev1.Secret]
	Create(ctx context.Context, s *corev1.Secret, opts metav1.CreateOptions) (*corev1.Secret, error)
	Update(ctx context.Context, s *corev1.Secret, opts metav1.UpdateOptions) (*corev1.Secret, error)
}

// WebhookConfigurationInterface: the webhook's configuration is read and
// its caBundle updated.
type WebhookConfigurationInterface interface {
	Getter[*admissionregistrationv1.MutatingWebhookConfiguration]
	Update(ctx context.Context, c *admissionregistrationv1.MutatingWebhookConfiguration, opts metav1.UpdateOptions) (*admissionregistrationv1.MutatingWebhookConfiguration, error)
}

// Secrets returns the Secrets of namespace.
func (c *Client) Secrets(namespace string) SecretInterface {
	return gentype.NewClient("secrets", c.core.rc, c.core.params, namespace,
		func() *corev1.Secret { return &corev1.Secret{} },
		gentype.PrefersProtobuf[*corev1.Secret]())
}

// MutatingWebhookConfigurations returns the cluster's mutating webhook
// configurations.
func (c *Client) MutatingWebhookConfigurations() WebhookConfigurationInterface {
	return c.adm.webhookConfigurations()
}

// ConfigMapInformer watches the one ConfigMap namespace/name (a field
// selector on its name: RBAC may grant list and watch of that name only).
func ConfigMapInformer(client *Client, namespace, name string) cache.SharedIndexInformer {
	lw := gentype.NewClientWithList("configmaps", client.core.rc, client.core.params, namespace,
		func() *corev1.ConfigMap { return &corev1.ConfigMap{} }, func() *corev1.ConfigMapList { return &corev1.ConfigMapList{} },
		gentype.PrefersProtobuf[*corev1.ConfigMap]())
	return newInformer[*corev1.ConfigMapList](client, lw, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
	}, &corev1.ConfigMap{})
}
