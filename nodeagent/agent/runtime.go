package agent

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// runtimeVerdict is policy.CheckRuntime on the runtime handler pod runs
// under: nil when its traffic passes through its network namespace (where
// the rules capture it), else a *policy.UncapturableRuntimeError. The
// handler is that of the RuntimeClass the pod names (from the informer,
// else a direct GET: one created a moment ago); a pod that names none is
// checked as policy.NoRuntimeClass, with no lookup. err (wrapping
// ErrAPIUnavailable) says the RuntimeClass could not be read: nothing is
// known, and the caller fails closed.
func (a *Agent) runtimeVerdict(ctx context.Context, pod *corev1.Pod) (verdict, err error) {
	class := ""
	if pod.Spec.RuntimeClassName != nil {
		class = *pod.Spec.RuntimeClassName
	}
	if class == "" {
		return a.cfg.Policy.CheckRuntime("", "", false), nil
	}
	if rc, err := a.rcLister.Get(class); err == nil {
		return a.cfg.Policy.CheckRuntime(class, rc.Handler, false), nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rc, err := a.client.NodeV1().RuntimeClasses().Get(ctx, class, metav1.GetOptions{})
	switch {
	case err == nil:
		return a.cfg.Policy.CheckRuntime(class, rc.Handler, false), nil
	case apierrors.IsNotFound(err):
		return a.cfg.Policy.CheckRuntime(class, "", true), nil
	}
	return nil, fmt.Errorf("%w: get RuntimeClass %s of pod %s/%s: %w", ErrAPIUnavailable, class, pod.Namespace, pod.Name, err)
}

// refuseUncapturable is the sync of a pod that belongs in the mesh but runs
// under a runtime handler the rules cannot capture (verdict): it is never
// enrolled nor reported in the mesh. One enrolled before (an agent started
// with another handler list, or one that did not check) is taken out of
// the mesh first. A CNI ADD (cni) is refused with the verdict, so the pod
// does not start; its sandbox's events say why. A running pod stays out of
// the mesh; publish gives it condition False with the verdict and an Event.
func (a *Agent) refuseUncapturable(ctx context.Context, log *slog.Logger, s *podSync, pod *corev1.Pod, e registry.Entry, registered, cni bool, verdict error) (Outcome, error) {
	s.uncapturable = verdict
	if registered {
		s.removing = true
		log.Warn("pod runs under a runtime handler the rules cannot capture; taking it out of the mesh", "error", verdict)
		if err := a.removeFromMesh(ctx, log, pod, e, "uncapturable_runtime"); err != nil {
			return OutcomeUnknown, err
		}
		s.removing = false
	}
	if cni {
		a.metrics.failure("invalid_pod")
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w: %w", pod.Namespace, pod.Name, ErrInvalidPod, verdict)
	}
	log.Debug("pod in the mesh not enrolled: uncapturable runtime handler", "error", verdict)
	return NotInMesh, nil
}

// publishUncapturable writes what a pod refused by refuseUncapturable shows:
// no redirection annotation, condition False/RuntimeNotCapturable with the
// verdict, and a Warning Event, both only when the pod does not show it
// already (a refused ADD the runtime retries, a pod update, records
// nothing new).
func (a *Agent) publishUncapturable(s podSync) {
	pod := s.pod
	msg := s.uncapturable.Error()
	want := podstatus.Status{Condition: podstatus.Condition{Status: corev1.ConditionFalse, Reason: ReasonRuntimeNotCapturable, Message: msg}}
	cur, has := a.shows(pod)
	if has && cur.Equal(want) {
		return
	}
	a.recorder.Event(refOf(pod.Namespace, pod.Name, string(pod.UID)), corev1.EventTypeWarning, EventRuntimeNotCapturable,
		"The pod belongs in the ambient mesh but is not enrolled: "+msg)
	want.Condition.Since = time.Now()
	if cur.Condition.Status == want.Condition.Status && !cur.Condition.Since.IsZero() {
		want.Condition.Since = cur.Condition.Since
	}
	a.status.Set(pod.Namespace, pod.Name, string(pod.UID), want)
}
