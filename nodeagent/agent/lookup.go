package agent

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
func (a *Agent) lookupPod(ctx context.Context, ev PodEvent) (*corev1.Pod, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.PodLookupTimeout)
	defer cancel()
	var (
		lastErr  error       // last GET failure other than NotFound
		notFound bool        // some GET answered NotFound
		seen     *corev1.Pod // a pod of that name with another uid
	)
	match := func(p *corev1.Pod) bool {
		if p != nil && ev.UID != "" && string(p.UID) != ev.UID {
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
