package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
)

// podLog returns the agent's logger with the pod's identity on every line.
func (a *Agent) podLog(namespace, name, uid string) *slog.Logger {
	return a.log.With("namespace", namespace, "pod", name, "uid", uid)
}

// podByUID returns the cached pod with uid, or nil.
func (a *Agent) podByUID(uid string) *corev1.Pod {
	objs, err := a.podInformer.GetIndexer().ByIndex(uidIndex, uid)
	if err != nil || len(objs) == 0 {
		return nil
	}
	p, _ := objs[0].(*corev1.Pod)
	return p
}

// podByName returns the cached pod namespace/name, or nil.
func (a *Agent) podByName(namespace, name string) *corev1.Pod {
	obj, ok, err := a.podInformer.GetIndexer().GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	p, _ := obj.(*corev1.Pod)
	return p
}

func (a *Agent) namespaceLabels(ctx context.Context, name string) (map[string]string, error) {
	if n, err := a.nsLister.Get(name); err == nil {
		return n.Labels, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := a.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get namespace %s: %w", name, err)
	}
	return n.Labels, nil
}

// decidePolicy applies the enrollment policy to pod (Agent.decide).
func (a *Agent) decidePolicy(ctx context.Context, pod *corev1.Pod) (policy.Decision, error) {
	labels, err := a.namespaceLabels(ctx, pod.Namespace)
	if err != nil && !apierrors.IsNotFound(errors.Unwrap(err)) {
		return policy.Decision{}, err
	}
	return a.cfg.Policy.Decide(pod, labels), nil
}

// runtimeUID returns the uid the container runtime knows pod by — what a
// CNI event carries as K8S_POD_UID and the pod's cgroup is named after: a
// mirror pod's static uid (podmeta.StaticUID), else the pod's API uid. A
// claim of a uid that is another pod's in the API is refused: a pod could
// otherwise have that pod's sandbox enrolled as itself.
func (a *Agent) runtimeUID(pod *corev1.Pod) string {
	if uid, ok := podmeta.StaticUID(pod, a.cfg.NodeName); ok {
		if other := a.podByUID(uid); other == nil || other.UID == pod.UID {
			return uid
		}
		a.podLog(pod.Namespace, pod.Name, string(pod.UID)).Warn("mirror pod claims the uid of another pod; not believed", "reason", "config.mirror "+uid)
	}
	return string(pod.UID)
}

// runtimeUIDOf is runtimeUID of the cached pod with API uid uid (uid itself
// when the cache does not have it).
func (a *Agent) runtimeUIDOf(uid string) string {
	if p := a.podByUID(uid); p != nil {
		return a.runtimeUID(p)
	}
	return uid
}
