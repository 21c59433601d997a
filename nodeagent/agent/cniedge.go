package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/policy"
)

// CNI is the agent's CNI edge: the handler the CNI server hands every ADD
// and DEL. An ADD is checked, its netns opened once and its pod looked up;
// then the pod's mode is decided once — ambient, sidecar or none — and the
// pod goes to the ambient core (Agent) or to sidecar mode. The ambient core
// knows nothing of sidecar mode.
type CNI struct {
	core *Agent
	// sidecar, when set, captures sidecar pods (SetSidecar); invalid is
	// its invalid-pod error.
	sidecar SidecarCapture
	invalid error
}

// NewCNI returns the CNI edge of the ambient core a; sidecar mode is off
// until SetSidecar.
func NewCNI(a *Agent) *CNI { return &CNI{core: a} }

// SidecarCapture is sidecar mode's CNI ADD: it programs the capture of a
// pod Istio's injector gave an istio-proxy (*sidecar.Tracker implements
// it), in the netns the ADD opened (the caller keeps and closes it). Its
// errors wrap sidecar.ErrInvalidAnnotation for a pod that cannot be
// programmed as it is.
type SidecarCapture interface {
	Capture(ctx context.Context, pod *corev1.Pod, netns *podnetns.Handle, ips []netip.Addr) error
}

// SetSidecar turns sidecar mode on: CNI ADDs of pods the policy makes
// sidecar pods go to s (never to ztunnel, never annotated); invalid is the
// error s wraps for a pod that cannot be programmed as it is. Call before
// the CNI server serves.
func (c *CNI) SetSidecar(s SidecarCapture, invalid error) {
	c.sidecar, c.invalid = s, invalid
}

// PodInformer is the agent's informer of this node's pods, shared with
// sidecar mode and the repair controller (add handlers before Run).
func (a *Agent) PodInformer() cache.SharedIndexInformer { return a.podInformer }

// mode is the data plane a CNI ADD puts its pod in.
type mode int

const (
	// modeNone: neither mesh. The ambient core still sees the ADD: a pod
	// it held that left the mesh is released, its status published.
	modeNone mode = iota
	modeAmbient
	modeSidecar
)

// modeOf is the pod's mode by the policy's decision d: a sidecar pod is one
// only while sidecar mode is on (off, its ADD succeeds with nothing done).
func (c *CNI) modeOf(d policy.Decision) mode {
	switch {
	case d.InMesh:
		return modeAmbient
	case d.Sidecar && c.sidecar != nil:
		return modeSidecar
	}
	return modeNone
}

// HandleAdd is the CNI ADD: it checks the event, opens the pod's netns
// (once: the handle an ambient enrollment keeps, or sidecar mode programs),
// looks the pod up, decides its mode (once) and hands it to the ambient
// core's sync or to sidecar mode, so a new pod is captured before its
// containers start. A pod whose rules cannot be programmed gets an error,
// so the runtime retries the sandbox and the pod never runs uncaptured.
func (c *CNI) HandleAdd(ctx context.Context, ev PodEvent) (out Outcome, err error) {
	a := c.core
	start := time.Now()
	ctx, trace := withAddTrace(ctx)
	trace.plugin(ev)
	defer func() {
		l := outcomeLabel(out, err)
		took := time.Since(start)
		a.metrics.cniAdds.WithLabelValues(l).Inc()
		a.metrics.cniAddTime.WithLabelValues(l).Observe(took.Seconds())
		trace.add("agent", took)
		a.metrics.observe(trace)
	}()
	if err := a.checkEvent(ev); err != nil {
		return OutcomeUnknown, err
	}
	trace.add("check", time.Since(start))
	opened := time.Now()
	h, err := a.openNetns(ev.NetnsPath)
	a.metrics.step(ctx, "netns", opened)
	if err != nil {
		return OutcomeUnknown, fmt.Errorf("pod %s/%s: %w", ev.Namespace, ev.Name, err)
	}
	in := &cniInput{netns: h}
	defer in.closeNetns() // unless the ambient core's enrollment took it
	lookup := time.Now()
	pod, err := a.lookupPod(ctx, ev)
	a.metrics.step(ctx, "lookup", lookup)
	if err != nil {
		a.metrics.failure("pod_unknown")
		return OutcomeUnknown, err
	}
	if pod == nil {
		return NotInMesh, nil // a static pod out of the mesh whose mirror pod the API does not show
	}
	release, err := a.addSlot(ctx, pod)
	if err != nil {
		return OutcomeUnknown, err
	}
	defer release()
	in.pod = pod
	for _, p := range ev.IPs {
		in.ips = append(in.ips, p.Addr().Unmap())
	}
	in.decision, in.decideErr = a.decide(ctx, pod)
	if in.decideErr == nil && c.modeOf(in.decision) == modeSidecar {
		return c.captureSidecar(ctx, pod, h, in.ips)
	}
	// Ambient, none, or not decided (the sync reports the API error as its
	// own): the ambient core's one per-pod sync.
	return a.sync(ctx, string(pod.UID), in)
}

// HandleDel is the CNI DEL: only the ambient core keeps anything of a
// sandbox (sidecar mode forgets a pod when its object goes).
func (c *CNI) HandleDel(ctx context.Context, ev PodEvent) error {
	return c.core.del(ctx, ev)
}

// addSlot waits, within the caller's deadline, for one of the bounded
// pool's slots (Config.MaxParallelAdds); release gives it back.
func (a *Agent) addSlot(ctx context.Context, pod *corev1.Pod) (release func(), err error) {
	wait := time.Now()
	select {
	case a.adds <- struct{}{}:
		traceOf(ctx).add("queue", time.Since(wait))
		return func() { <-a.adds }, nil
	case <-ctx.Done():
		a.metrics.failure("deadline")
		return nil, fmt.Errorf("pod %s/%s: waiting for one of %d enrollment slots: %w", pod.Namespace, pod.Name, cap(a.adds), ctx.Err())
	}
}

// captureSidecar hands a sidecar pod to sidecar mode, in the netns h the
// ADD opened.
func (c *CNI) captureSidecar(ctx context.Context, pod *corev1.Pod, h *podnetns.Handle, ips []netip.Addr) (Outcome, error) {
	if err := c.sidecar.Capture(ctx, pod, h, ips); err != nil {
		if c.invalid != nil && errors.Is(err, c.invalid) {
			c.core.metrics.failure("bad_annotation")
			return OutcomeUnknown, fmt.Errorf("%w: %w", ErrInvalidPod, err)
		}
		c.core.metrics.failure("rules")
		return OutcomeUnknown, fmt.Errorf("%w: %w", ErrNotCaptured, err)
	}
	return SidecarCaptured, nil
}

// checkEvent refuses at once what can never be a pod's CNI event: a name or
// namespace no pod can have (the pod lookup would only wait its timeout for
// it) and a uid that is not one. An ADD's netns path is checked as it is
// opened (openNetns).
func (a *Agent) checkEvent(ev PodEvent) error {
	var errs []string
	if msgs := validation.IsDNS1123Subdomain(ev.Name); len(msgs) > 0 {
		errs = append(errs, fmt.Sprintf("pod name %q: %s", ev.Name, strings.Join(msgs, "; ")))
	}
	if msgs := validation.IsDNS1123Label(ev.Namespace); len(msgs) > 0 {
		errs = append(errs, fmt.Sprintf("namespace %q: %s", ev.Namespace, strings.Join(msgs, "; ")))
	}
	if ev.UID != "" && (len(ev.UID) > 128 || strings.ContainsAny(ev.UID, "/ \t\n\x00")) {
		errs = append(errs, fmt.Sprintf("pod uid %q is not a uid", ev.UID))
	}
	if len(errs) > 0 {
		a.metrics.failure("invalid_pod")
		return fmt.Errorf("%w: CNI event names no possible pod: %s", ErrInvalidPod, strings.Join(errs, ", "))
	}
	return nil
}
