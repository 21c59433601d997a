package agent

import (
	"context"
	"errors"
	"net/netip"
	"os"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/podmeta"
)

// del is the CNI DEL (the edge's HandleDel): the pod's sandbox is being
// torn down. ztunnel is told to drop the pod. A pod whose object is gone (or
// going) is forgotten; a pod that still exists keeps its registration as
// Uncaptured — pending, condition False ("sandbox gone, waiting for
// re-enrollment") — until its next sandbox is enrolled (its ADD, or found by
// a retry when the ADD misses us). Rules die with the namespace. A DEL about another sandbox
// than the one the pod is enrolled in (a late DEL of a recreated pod's old
// sandbox) changes nothing. A pod we do not know is success.
func (a *Agent) del(ctx context.Context, ev PodEvent) error {
	if err := a.checkEvent(ev); err != nil {
		a.log.Warn("CNI DEL for no possible pod; nothing to do", "error", err)
		return nil
	}
	uids := a.reg.FindByName(ev.Namespace, ev.Name)
	switch {
	case ev.UID != "":
		// The runtime's uid: the pod's, or the static uid of a mirror
		// pod registered under its API uid.
		named := uids
		uids = nil
		if _, ok := a.reg.Get(ev.UID); ok {
			uids = append(uids, ev.UID)
		}
		for _, uid := range named {
			if uid != ev.UID && a.runtimeUIDOf(uid) == ev.UID {
				uids = append(uids, uid)
			}
		}
	case len(uids) > 1:
		// No uid from the runtime and several pods of that name (a
		// StatefulSet pod recreated): only the one whose netns this is.
		uids = a.uidsWithNetns(uids, ev.NetnsPath)
		if len(uids) == 0 {
			a.log.Warn("CNI DEL without pod uid matches several pods and none by netns; left to the informer",
				"namespace", ev.Namespace, "pod", ev.Name, "netns", ev.NetnsPath)
		}
	}
	var errs []error
	for _, uid := range uids {
		if err := a.delOne(ctx, uid, ev); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (a *Agent) delOne(ctx context.Context, uid string, ev PodEvent) error {
	unlock, err := a.locks.lockCtx(ctx, uid)
	if err != nil {
		return err
	}
	defer unlock()
	e, ok := a.reg.Get(uid)
	if !ok {
		return nil
	}
	log := a.podLog(e.Namespace, e.Name, uid)
	pod := a.podByUID(uid)
	if a.otherNetns(e, pod, ev.NetnsPath) {
		// A late DEL of an earlier sandbox of this pod (the runtime
		// recreated it): the live one must not lose its enrollment.
		log.Info("CNI DEL names another network namespace than the pod's; ignored",
			"del_netns", ev.NetnsPath, "pod_netns", e.Netns.Path())
		return nil
	}
	if pod == nil || pod.DeletionTimestamp != nil || !a.isRunning(pod) || e.Phase == registry.Releasing {
		err := a.forget(ctx, e, "sandbox_deleted")
		a.takeMoved(uid) // gone: nothing to publish
		return err
	}
	// The pod stays: its sandbox goes, and a new one comes. Until it is
	// enrolled there, the pod is not captured, and shows it.
	if err := a.zt.DelWorkload(ctx, uid); err != nil {
		log.Warn("telling ztunnel to drop the pod's deleted sandbox", "error", err)
	}
	s := podSync{pod: pod, inMesh: true}
	if _, err := a.leaveSandbox(ctx, log, &s, e, podmeta.IPs(pod), "sandbox gone (CNI DEL), waiting for re-enrollment"); err != nil {
		return err
	}
	a.queue.AddRateLimited(uid) // its next sandbox may come without an ADD to us
	return nil
}

// isRunning reports whether pod may still get or have a sandbox: not
// terminal.
func (a *Agent) isRunning(pod *corev1.Pod) bool {
	return pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed
}

// otherNetns reports whether a DEL naming path is about another sandbox
// than the one e holds:
//   - path exists: it is not the held namespace;
//   - path is empty: the held namespace is still where it was opened
//     (containerd 1.6 repeats DEL with an empty CNI_NETNS when kubelet
//     removes a dead sandbox, which for a recreated pod comes while the new
//     sandbox runs);
//   - path is gone: it is not the path the held namespace was opened from,
//     and the held one is still the pod's current sandbox (its path still
//     names it, it holds the pod's IPs). A runtime that removes an old
//     sandbox netns first and DELs it afterwards must not drop the live one.
func (a *Agent) otherNetns(e registry.Entry, pod *corev1.Pod, path string) bool {
	if e.Netns == nil {
		return false
	}
	if path == "" {
		return e.Netns.SameAs(e.Netns.Path())
	}
	if _, err := os.Stat(path); err == nil {
		return !e.Netns.SameAs(path)
	}
	if path == e.Netns.Path() {
		return false
	}
	var ips []netip.Addr
	if pod != nil {
		ips = podmeta.IPs(pod)
	}
	return a.notCurrent(e, ips) == ""
}

// uidsWithNetns returns those of uids whose registered netns is the one at
// path. A path that is gone matches none.
func (a *Agent) uidsWithNetns(uids []string, path string) []string {
	var out []string
	for _, uid := range uids {
		if e, ok := a.reg.Get(uid); ok && e.Netns != nil && e.Netns.SameAs(path) {
			out = append(out, uid)
		}
	}
	return out
}
