package agent

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
)

// The direct GETs of a pod the informer has not seen back off from
// lookupBackoffBase, doubling up to lookupBackoffMax: a burst of CNI ADDs
// during an informer lag must not turn into a GET storm.
const (
	lookupBackoffBase = 100 * time.Millisecond
	lookupBackoffMax  = 2 * time.Second
	lookupGetTimeout  = 2 * time.Second
)

// lookupPod finds the pod of a CNI event: first it waits on the informer (a
// new pod is usually there within milliseconds; every pod event wakes the
// wait), after CacheWait it also asks the API directly, with capped
// exponential backoff, until PodLookupTimeout. A pod the API does not know is
// ErrPodUnknown; an API that cannot be asked is ErrAPIUnavailable.
//
// The pod is the one of that namespace/name whose uid is the runtime's, or
// — a static pod — whose mirror pod stands for the runtime's uid
// (runtimeUID). A runtime uid that no API pod can have (podmeta.APIAssigned)
// in a namespace that does not put its pods in the mesh is waited for only
// CacheWait and one GET: only its mirror pod's labels could enroll it, and a
// mirror pod the kubelet could not create (yet) must not keep a static pod
// out of the mesh from starting; such a pod is nil with no error (not in the
// mesh; its mirror pod, once it comes, is synced like any running pod).
func (a *Agent) lookupPod(ctx context.Context, ev PodEvent) (*corev1.Pod, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.PodLookupTimeout)
	defer cancel()
	static := ev.UID != "" && !podmeta.APIAssigned(ev.UID)
	if static {
		labels, err := a.namespaceLabels(ctx, ev.Namespace)
		if err == nil && labels[podmeta.LabelDataplaneMode] != podmeta.ModeAmbient {
			return a.lookupStatic(ctx, ev)
		}
	}
	var (
		lastErr  error       // last GET failure other than NotFound
		notFound bool        // some GET answered NotFound
		seen     *corev1.Pod // a pod of that name with another uid
	)
	match := func(p *corev1.Pod) bool {
		if p != nil && !a.isRuntimePod(p, ev.UID) {
			seen = p
			return false
		}
		return p != nil
	}
	next := time.NewTimer(a.cfg.CacheWait) // the first GET
	defer next.Stop()
	backoff := lookupBackoffBase
	for {
		wake := a.podSeen.wait()
		if p := a.podByName(ev.Namespace, ev.Name); match(p) {
			return p, nil
		}
		select {
		case <-wake:
			continue // the informer saw a pod: look again
		case <-ctx.Done():
			return nil, a.lookupErr(ev, seen, notFound, lastErr)
		case <-next.C:
		}
		gctx, gcancel := context.WithTimeout(ctx, lookupGetTimeout)
		p, err := a.client.CoreV1().Pods(ev.Namespace).Get(gctx, ev.Name, metav1.GetOptions{})
		gcancel()
		switch {
		case err == nil && match(p):
			return p, nil
		case err == nil:
		case apierrors.IsNotFound(err):
			notFound = true
		case ctx.Err() == nil:
			lastErr = err // not just cut short by our own deadline
		}
		next.Reset(backoff)
		backoff = min(2*backoff, lookupBackoffMax)
	}
}

func (a *Agent) lookupErr(ev PodEvent, seen *corev1.Pod, notFound bool, lastErr error) error {
	switch {
	case seen != nil:
		return fmt.Errorf("pod %s/%s: the API has uid %s, the runtime says %s (waited %v): %w", ev.Namespace, ev.Name, seen.UID, ev.UID, a.cfg.PodLookupTimeout, ErrPodUnknown)
	case notFound || lastErr == nil:
		return fmt.Errorf("pod %s/%s (uid %q) not found in the Kubernetes API (waited %v): %w", ev.Namespace, ev.Name, ev.UID, a.cfg.PodLookupTimeout, ErrPodUnknown)
	}
	return fmt.Errorf("pod %s/%s: not in the informer cache and the API is unreachable (waited %v): %w: %w", ev.Namespace, ev.Name, a.cfg.PodLookupTimeout, ErrAPIUnavailable, lastErr)
}

// isRuntimePod reports whether p is the pod the runtime calls uid (any pod
// of its name when the runtime passed none).
func (a *Agent) isRuntimePod(p *corev1.Pod, uid string) bool {
	return uid == "" || string(p.UID) == uid || a.runtimeUID(p) == uid
}

// lookupStatic is lookupPod for a static pod in a namespace out of the
// mesh: the informer for CacheWait, then one GET; a mirror pod not found is
// a nil pod.
func (a *Agent) lookupStatic(ctx context.Context, ev PodEvent) (*corev1.Pod, error) {
	wait, cancel := context.WithTimeout(ctx, a.cfg.CacheWait)
	defer cancel()
	for {
		wake := a.podSeen.wait()
		if p := a.podByName(ev.Namespace, ev.Name); p != nil && a.isRuntimePod(p, ev.UID) {
			return p, nil
		}
		select {
		case <-wake:
			continue
		case <-wait.Done():
		}
		break
	}
	gctx, gcancel := context.WithTimeout(ctx, lookupGetTimeout)
	p, err := a.client.CoreV1().Pods(ev.Namespace).Get(gctx, ev.Name, metav1.GetOptions{})
	gcancel()
	if err == nil && a.isRuntimePod(p, ev.UID) {
		return p, nil
	}
	a.log.Info("static pod without its mirror pod in a namespace out of the mesh; left alone (its mirror pod is enrolled when it comes, if labelled)",
		"namespace", ev.Namespace, "pod", ev.Name, "uid", ev.UID)
	return nil, nil
}
