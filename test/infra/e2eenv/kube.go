package e2eenv

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
)

// ApplyManifest creates (or updates, when they exist) the ServiceAccounts,
// ClusterRoles, ClusterRoleBindings, Roles and RoleBindings of a multi-document
// YAML file such as deploy/rbac.yaml. Objects without a namespace that need
// one get defaultNamespace (what kustomize's namespace: does). Other kinds are
// an error, so a manifest the environment silently ignores cannot happen.
func ApplyManifest(ctx context.Context, c kubernetes.Interface, path, defaultNamespace string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read manifest: %w", err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	decode := scheme.Codecs.UniversalDeserializer().Decode
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: document %d: %w", path, i, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, gvk, err := decode(doc, nil, nil)
		if err != nil {
			return fmt.Errorf("%s: document %d: %w", path, i, err)
		}
		if err := applyObject(ctx, c, obj, defaultNamespace); err != nil {
			return fmt.Errorf("%s: %s document %d: %w", path, gvk.Kind, i, err)
		}
	}
}

func stripComments(doc []byte) []byte {
	var out [][]byte
	for _, l := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
			out = append(out, l)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

func applyObject(ctx context.Context, c kubernetes.Interface, obj any, defaultNamespace string) error {
	ns := func(m *metav1.ObjectMeta) string {
		if m.Namespace == "" {
			m.Namespace = defaultNamespace
		}
		return m.Namespace
	}
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		return createOrUpdate(ctx, c.CoreV1().ServiceAccounts(ns(&o.ObjectMeta)), o)
	case *rbacv1.ClusterRole:
		return createOrUpdate(ctx, c.RbacV1().ClusterRoles(), o)
	case *rbacv1.ClusterRoleBinding:
		for i := range o.Subjects {
			if o.Subjects[i].Kind == rbacv1.ServiceAccountKind && o.Subjects[i].Namespace == "" {
				o.Subjects[i].Namespace = defaultNamespace
			}
		}
		return createOrUpdate(ctx, c.RbacV1().ClusterRoleBindings(), o)
	case *rbacv1.Role:
		return createOrUpdate(ctx, c.RbacV1().Roles(ns(&o.ObjectMeta)), o)
	case *rbacv1.RoleBinding:
		return createOrUpdate(ctx, c.RbacV1().RoleBindings(ns(&o.ObjectMeta)), o)
	default:
		return fmt.Errorf("kind %T is not supported by ApplyManifest", obj)
	}
}

type createUpdater[T any] interface {
	Create(context.Context, T, metav1.CreateOptions) (T, error)
	Update(context.Context, T, metav1.UpdateOptions) (T, error)
}

func createOrUpdate[T any](ctx context.Context, c createUpdater[T], obj T) error {
	_, err := c.Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		_, err = c.Update(ctx, obj, metav1.UpdateOptions{})
	}
	return err
}

// CreateNamespace creates a namespace with labels and its "default" service
// account (the controller-manager would create it; none runs here).
func (e *Env) CreateNamespace(ctx context.Context, name string, labels map[string]string) (*corev1.Namespace, error) {
	ns, err := e.CP.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create namespace %s: %w", name, err)
	}
	if err := e.EnsureServiceAccount(ctx, name, "default"); err != nil {
		return nil, err
	}
	return ns, nil
}

// EnsureServiceAccount creates namespace/name unless it exists. Pods name a
// service account, and the ServiceAccount admission plugin rejects pods whose
// account is missing.
func (e *Env) EnsureServiceAccount(ctx context.Context, namespace, name string) error {
	_, err := e.CP.Admin.CoreV1().ServiceAccounts(namespace).Create(ctx, &corev1.ServiceAccount{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create service account %s/%s: %w", namespace, name, err)
	}
	return nil
}

// CreateNode registers a Node object, optionally with taints, marked Ready
// the way a kubelet would report it.
func CreateNode(ctx context.Context, c kubernetes.Interface, name string, taints []corev1.Taint) (*corev1.Node, error) {
	n, err := c.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
		Spec:       corev1.NodeSpec{Taints: taints},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create node %s: %w", name, err)
	}
	n.Status.Conditions = []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
		LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now(),
	}}
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}, {Type: corev1.NodeHostName, Address: name}}
	n, err = c.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("update node %s status: %w", name, err)
	}
	return n, nil
}

// WaitForPod polls the pod (every 100ms, through the admin client) until cond
// is true, cond fails, or ctx ends; it returns the last pod seen.
func (e *Env) WaitForPod(ctx context.Context, namespace, name string, cond func(*corev1.Pod) (bool, error)) (*corev1.Pod, error) {
	var last *corev1.Pod
	var lastErr error
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := e.CP.Admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			lastErr = err
			return false, nil
		}
		last = p
		return cond(p)
	})
	if err != nil {
		if last != nil {
			return last, fmt.Errorf("wait for pod %s/%s: %w (annotations now: %v)", namespace, name, err, last.Annotations)
		}
		return nil, fmt.Errorf("wait for pod %s/%s: %w (last error: %v)", namespace, name, err, lastErr)
	}
	return last, nil
}

// WaitForPodAnnotation waits until the pod's annotation key equals want.
func (e *Env) WaitForPodAnnotation(ctx context.Context, namespace, name, key, want string) (*corev1.Pod, error) {
	return e.WaitForPod(ctx, namespace, name, func(p *corev1.Pod) (bool, error) {
		return p.Annotations[key] == want, nil
	})
}
