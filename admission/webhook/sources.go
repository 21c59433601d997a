package webhook

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/admission"
)

// ClusterInputs reads the decision's inputs from informers: the agent's
// ConfigMap (the policy's param) and every namespace's labels (the
// policy's namespaceObject). A namespace not in the cache yet (created an
// instant before its first pod) is read from the API.
type ClusterInputs struct {
	ConfigMap  cache.SharedIndexInformer // the one ConfigMap
	Namespaces cache.SharedIndexInformer
	// GetNamespace reads a namespace the cache does not have.
	GetNamespace func(ctx context.Context, name string) (*corev1.Namespace, error)
}

// Settings implements Inputs: the ConfigMap's data read as the agent and
// the policy read it; ok=false without a ConfigMap.
func (c ClusterInputs) Settings() (admission.Settings, bool) {
	objs := c.ConfigMap.GetStore().List()
	if len(objs) == 0 {
		return admission.Settings{}, false
	}
	cm, ok := objs[0].(*corev1.ConfigMap)
	if !ok {
		return admission.Settings{}, false
	}
	return admission.SettingsFrom(cm.Data), true
}

// NamespaceLabels implements Inputs.
func (c ClusterInputs) NamespaceLabels(ctx context.Context, name string) (map[string]string, error) {
	if o, ok, err := c.Namespaces.GetStore().GetByKey(name); err == nil && ok {
		if ns, ok := o.(*corev1.Namespace); ok {
			return ns.Labels, nil
		}
	}
	ns, err := c.GetNamespace(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("read namespace: %w", err)
	}
	return ns.Labels, nil
}

// getNamespace adapts a typed Get.
func getNamespace(g interface {
	Get(context.Context, string, metav1.GetOptions) (*corev1.Namespace, error)
}) func(context.Context, string) (*corev1.Namespace, error) {
	return func(ctx context.Context, name string) (*corev1.Namespace, error) {
		return g.Get(ctx, name, metav1.GetOptions{})
	}
}
