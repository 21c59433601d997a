package agent

import (
	"context"
	"errors"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
)

// errNetnsNeverFound: the pod's network namespace was never found, so its
// rules, if any, cannot be reached.
var errNetnsNeverFound = errors.New("its network namespace was never found")

// releaseAtUninstall runs as Run stops when ambientd is uninstalled from
// the node with no node agent after it (Config.Uninstalling, --handover
// none). Nothing will write the pods' condition again, so a gated pod left
// False would be NotReady for ever — and its rules, left in place, would
// send its traffic to a ztunnel that does not carry it. Each pod the agent
// holds whose condition is False has its rules removed and is set
// True/Uninstalled with the annotation removed: it runs outside the mesh,
// and says so. One whose rules cannot be removed (or whose network
// namespace was never found) gets False/NotReleased: its capture is not
// known. Pods whose condition is True keep their rules and condition, as
// at every uninstall: ztunnel carries them while it runs.
func (a *Agent) releaseAtUninstall(ctx context.Context) {
	start := time.Now()
	released, failed := 0, 0
	for _, h := range a.heldFalse() {
		pod, e, cur := h.pod, h.entry, h.cur
		if e.Phase == registry.Releasing {
			continue // its rules are already gone (or going with the pod)
		}
		log := a.podLog(pod.Namespace, pod.Name, string(pod.UID))
		want := podstatus.Status{Condition: podstatus.Condition{
			Status: corev1.ConditionTrue, Reason: ReasonUninstalled, Since: time.Now(),
			Message: "ambientd was uninstalled from the node with no node agent after it: the pod's rules were removed and its traffic is no longer captured (it runs outside the mesh); it was False: " + cur.Condition.Message,
		}}
		var err error
		if e.Netns == nil {
			err = errNetnsNeverFound
		} else {
			err = a.rules.DeletePod(ctx, e.Netns)
		}
		if err != nil {
			log.Error("uninstall: the rules of a pod not in the mesh could not be removed; it stays not ready", "error", err)
			want = podstatus.Status{Redirection: cur.Redirection, Condition: podstatus.Condition{
				Status: corev1.ConditionFalse, Reason: ReasonNotReleased, Since: cur.Condition.Since,
				Message: "ambientd was uninstalled from the node with no node agent after it, and this pod's rules could not be removed (" + err.Error() + "): its traffic may be captured with nothing to carry it; it was False: " + cur.Condition.Message,
			}}
			failed++
		} else {
			log.Info("uninstall: pod released: its rules removed, condition True/Uninstalled")
			released++
		}
		a.status.Set(pod.Namespace, pod.Name, string(pod.UID), want)
	}
	if released+failed == 0 {
		return
	}
	if err := a.status.Flush(ctx); err != nil {
		a.log.Error("uninstall: pods whose condition was False may stay NotReady", "pods", released+failed, "error", err)
		return
	}
	logf := a.log.Info
	if failed > 0 {
		logf = a.log.Error
	}
	logf("uninstall: pods whose condition was False released", "released", released, "failed", failed, "took", time.Since(start).Round(time.Millisecond))
}
