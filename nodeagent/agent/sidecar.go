package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"
)

// SidecarCapture is sidecar mode's CNI ADD: it programs the capture of a
// pod Istio's injector gave an istio-proxy (*sidecar.Tracker implements
// it). Its errors wrap sidecar.ErrInvalidAnnotation for a pod that cannot
// be programmed as it is.
type SidecarCapture interface {
	Capture(ctx context.Context, pod *corev1.Pod, netnsPath string, ips []netip.Addr) error
}

// SetSidecar turns sidecar mode on: CNI ADDs of pods the policy makes
// sidecar pods go to s (never to ztunnel, never annotated). Call before Run.
func (a *Agent) SetSidecar(s SidecarCapture, invalid error) {
	a.sidecar, a.sidecarInvalid = s, invalid
}

// PodInformer is the agent's informer of this node's pods, shared with
// sidecar mode and the repair controller (add handlers before Run).
func (a *Agent) PodInformer() cache.SharedIndexInformer { return a.podInformer }

// addSidecar captures pod through sidecar mode when the policy makes it a
// sidecar pod (handled = true); otherwise the pod takes the ambient path.
func (a *Agent) addSidecar(ctx context.Context, pod *corev1.Pod, netnsPath string, ips []netip.Addr) (out Outcome, err error, handled bool) {
	if a.sidecar == nil {
		return OutcomeUnknown, nil, false
	}
	d, err := a.decide(ctx, pod)
	if err != nil {
		a.metrics.failure("api")
		return OutcomeUnknown, fmt.Errorf("decide about pod %s/%s: %w", pod.Namespace, pod.Name, err), true
	}
	if !d.Sidecar {
		return OutcomeUnknown, nil, false
	}
	if err := a.sidecar.Capture(ctx, pod, netnsPath, ips); err != nil {
		if a.sidecarInvalid != nil && errors.Is(err, a.sidecarInvalid) {
			a.metrics.failure("bad_annotation")
			return OutcomeUnknown, fmt.Errorf("%w: %w", ErrInvalidPod, err), true
		}
		a.metrics.failure("rules")
		return OutcomeUnknown, fmt.Errorf("%w: %w", ErrNotCaptured, err), true
	}
	return SidecarCaptured, nil, true
}
