package e2eenv

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PodSpec describes a pod for CreatePod.
type PodSpec struct {
	Namespace, Name string
	Labels          map[string]string
	Annotations     map[string]string
	// ServiceAccount defaults to "default"; it is created if missing.
	ServiceAccount string
	// Mutate, if set, may change the Pod object before it is created
	// (readiness gates, host network, extra containers...).
	Mutate func(*corev1.Pod)
	// Chain runs the pod's CNI (default Env.Chain; Env.PlainChain leaves
	// our plugin out).
	Chain *Chain
	// StaticUID makes the pod a static pod as the kubelet runs one: the
	// sandbox (its cgroup, K8S_POD_UID) has this uid, the API object is its
	// mirror pod (controlled by the Node, annotated config.mirror and
	// config.hash = StaticUID, no service account).
	StaticUID string
}

// InjectedPodSpec is a PodSpec of the pod an injector made (Istio's, for
// sidecar mode): its labels, annotations, init and regular containers, in
// namespace ns as name. Volumes and mounts are dropped: the environment
// runs no containers.
func InjectedPodSpec(injected *corev1.Pod, ns, name string) PodSpec {
	return PodSpec{Namespace: ns, Name: name, Labels: maps.Clone(injected.Labels), Annotations: maps.Clone(injected.Annotations),
		Mutate: func(p *corev1.Pod) {
			p.Spec.InitContainers = slices.Clone(injected.Spec.InitContainers)
			p.Spec.Containers = slices.Clone(injected.Spec.Containers)
			p.Spec.Volumes = nil
			for _, cs := range [][]corev1.Container{p.Spec.InitContainers, p.Spec.Containers} {
				for i := range cs {
					cs[i].VolumeMounts = nil
				}
			}
		}}
}

// The kubelet's mirror pod annotations (k8s.io/kubelet/pkg/types).
const (
	annConfigMirror = "kubernetes.io/config.mirror"
	annConfigHash   = "kubernetes.io/config.hash"
	annConfigSource = "kubernetes.io/config.source"
)

// Pod is a pod the environment created: the API object, its network
// namespace and what the CNI chain assigned.
type Pod struct {
	Namespace, Name string
	UID             string // the API object's
	// RuntimeUID is the uid the runtime runs the sandbox under (cgroup,
	// K8S_POD_UID): UID, or a static pod's StaticUID.
	RuntimeUID  string
	ContainerID string
	Netns       ns.NetNS
	NetnsPath   string
	IPs         []netip.Addr
	Result      *current.Result
	// AddDuration is how long the chain's CNI ADD took (libcni, every
	// plugin of the chain), for benchmarks.
	AddDuration time.Duration
	// Object is the Pod as last written by CreatePod (status Running).
	Object *corev1.Pod

	chain     *Chain
	sandbox   *Process // the pause process in Netns and in cgroupDir
	cgroupDir string
	requestIP netip.Addr // asked of host-local at ADD (RecreateSandbox SameIP)
}

// Attachment is what the chain was run with for this pod.
func (p *Pod) Attachment() Attachment { return p.attachment() }

// IP is the pod's first IP.
func (p *Pod) IP() netip.Addr {
	if len(p.IPs) == 0 {
		return netip.Addr{}
	}
	return p.IPs[0]
}

func (p *Pod) attachment() Attachment {
	return Attachment{ContainerID: p.ContainerID, NetnsPath: p.NetnsPath, PodName: p.Name, PodNamespace: p.Namespace, PodUID: p.RuntimeUID, IP: p.requestIP}
}

// CreatePod does what the scheduler, kubelet and container runtime do for a
// new pod on this node: create the Pod object bound to the node (status
// Pending), then the runtime's part (see AttachPod: sandbox network namespace,
// a pause process in it and in the pod's cgroup, CNI ADD through the chain),
// then patch pods/status to Running with the assigned IPs. If anything fails,
// DEL runs, the sandbox, netns and Pod object are removed, and the error (see
// IsCNIError) is returned.
func (e *Env) CreatePod(ctx context.Context, spec PodSpec) (*Pod, error) {
	if spec.ServiceAccount == "" && spec.StaticUID == "" {
		spec.ServiceAccount = "default"
	}
	if spec.ServiceAccount != "" {
		if err := e.EnsureServiceAccount(ctx, spec.Namespace, spec.ServiceAccount); err != nil {
			return nil, err
		}
	}
	obj := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Namespace: spec.Namespace, Labels: spec.Labels, Annotations: spec.Annotations},
		Spec: corev1.PodSpec{
			NodeName:                      e.NodeName,
			ServiceAccountName:            spec.ServiceAccount,
			TerminationGracePeriodSeconds: new(int64),
			Containers:                    []corev1.Container{{Name: "app", Image: "registry.invalid/e2e/app:1"}},
		},
	}
	runtimeUID := spec.StaticUID
	if spec.StaticUID != "" {
		n, err := e.CP.Admin.CoreV1().Nodes().Get(ctx, e.NodeName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("mirror pod %s/%s: its node: %w", spec.Namespace, spec.Name, err)
		}
		if obj.Annotations == nil {
			obj.Annotations = map[string]string{}
		}
		obj.Annotations[annConfigMirror], obj.Annotations[annConfigHash], obj.Annotations[annConfigSource] = spec.StaticUID, spec.StaticUID, "file"
		yes := true
		obj.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID, Controller: &yes}}
	}
	if spec.Mutate != nil {
		spec.Mutate(obj)
	}
	obj, err := e.CP.Admin.CoreV1().Pods(spec.Namespace).Create(ctx, obj, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create pod %s/%s: %w", spec.Namespace, spec.Name, err)
	}
	if runtimeUID == "" {
		runtimeUID = string(obj.UID)
	}
	p, err := e.attach(ctx, obj, spec.Chain, netip.Addr{}, runtimeUID)
	if err != nil {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		derr := e.CP.Admin.CoreV1().Pods(obj.Namespace).Delete(cctx, obj.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		if derr != nil && !apierrors.IsNotFound(derr) {
			err = errors.Join(err, fmt.Errorf("delete pod %s/%s: %w", obj.Namespace, obj.Name, derr))
		}
		return nil, err
	}
	if p.Object, err = e.MarkRunning(ctx, obj, p.IPs); err != nil {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return nil, errors.Join(err, e.DeletePod(cctx, p))
	}
	return p, nil
}

// AttachPod does the container runtime's part for an existing Pod object
// (obj needs its name, namespace and uid): create the sandbox's network
// namespace, start the sandbox's pause process inside it and inside a cgroup
// named after the pod uid (so a /proc scan finds it as on a real node), and
// run CNI ADD (loopback, then chain, or Env.Chain when chain is nil) with
// K8S_POD_NAME/NAMESPACE/UID/INFRA_CONTAINER_ID. It does not call the API, so
// it works while kube-apiserver is down; MarkRunning is the kubelet's status
// update. On error everything it made is undone. DeletePod (or Env.Close)
// tears the result down.
func (e *Env) AttachPod(ctx context.Context, obj *corev1.Pod, chain *Chain) (*Pod, error) {
	return e.attach(ctx, obj, chain, netip.Addr{}, string(obj.UID))
}

// attach is AttachPod asking host-local for ip when it is valid, the
// sandbox run under runtimeUID.
func (e *Env) attach(ctx context.Context, obj *corev1.Pod, chain *Chain, ip netip.Addr, runtimeUID string) (*Pod, error) {
	if chain == nil {
		chain = e.Chain
	}
	p := &Pod{Namespace: obj.Namespace, Name: obj.Name, UID: string(obj.UID), RuntimeUID: runtimeUID, ContainerID: "e2e-" + randHex(12), chain: chain, requestIP: ip}
	fail := func(err error) (*Pod, error) {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		e.untrack(p)
		return nil, errors.Join(err, p.teardown(cctx))
	}
	e.track(p)
	var err error
	if p.Netns, err = NewNetns(e.netnsDir, p.Namespace+"_"+p.Name+"_"+p.ContainerID); err != nil {
		return fail(fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err))
	}
	p.NetnsPath = p.Netns.Path()
	if err := e.startSandbox(ctx, p); err != nil {
		return fail(err)
	}
	addStart := time.Now()
	p.Result, err = p.chain.Add(ctx, p.attachment())
	p.AddDuration = time.Since(addStart)
	if err != nil {
		return fail(err)
	}
	for _, ipc := range p.Result.IPs {
		if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok {
			p.IPs = append(p.IPs, a.Unmap())
		}
	}
	if len(p.IPs) == 0 {
		return fail(fmt.Errorf("pod %s/%s: CNI ADD returned no IPs: %v", p.Namespace, p.Name, p.Result))
	}
	return p, nil
}

// MarkRunning sets the pod's status as the kubelet would once the sandbox has
// its IPs: phase Running, podIP(s), hostIP, Ready.
func (e *Env) MarkRunning(ctx context.Context, obj *corev1.Pod, ips []netip.Addr) (*corev1.Pod, error) {
	var err error
	for range 10 {
		var out *corev1.Pod
		out, err = e.markRunning(ctx, obj, ips)
		if !apierrors.IsConflict(err) {
			return out, err
		}
	}
	return nil, err
}

func (e *Env) markRunning(ctx context.Context, obj *corev1.Pod, ips []netip.Addr) (*corev1.Pod, error) {
	now := metav1.Now()
	obj = obj.DeepCopy()
	obj.Status.Phase = corev1.PodRunning
	obj.Status.HostIP = "127.0.0.1"
	obj.Status.HostIPs = []corev1.HostIP{{IP: "127.0.0.1"}}
	obj.Status.PodIP = ips[0].String()
	obj.Status.PodIPs = nil
	for _, ip := range ips {
		obj.Status.PodIPs = append(obj.Status.PodIPs, corev1.PodIP{IP: ip.String()})
	}
	obj.Status.StartTime = &now
	obj.Status.Conditions = []corev1.PodCondition{
		// Moves whenever a sandbox gets its network (kubelet 1.29+).
		{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
	}
	obj.Status.ContainerStatuses = []corev1.ContainerStatus{{
		Name: "app", Ready: true, Image: obj.Spec.Containers[0].Image,
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
	}}
	// Keep conditions other writers (the agent's readiness condition) set
	// since the object was read.
	if cur, err := e.CP.Admin.CoreV1().Pods(obj.Namespace).Get(ctx, obj.Name, metav1.GetOptions{}); err == nil {
		obj.ResourceVersion = cur.ResourceVersion
		obj.Annotations = cur.Annotations
		for _, c := range cur.Status.Conditions {
			if !isKubeletCondition(c.Type) {
				obj.Status.Conditions = append(obj.Status.Conditions, c)
			}
		}
	}
	out, err := e.CP.Admin.CoreV1().Pods(obj.Namespace).UpdateStatus(ctx, obj, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("update pod %s/%s status to Running: %w", obj.Namespace, obj.Name, err)
	}
	return out, nil
}

func isKubeletCondition(t corev1.PodConditionType) bool {
	switch t {
	case corev1.PodReadyToStartContainers, corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady:
		return true
	}
	return false
}

// SandboxOptions adjust RecreateSandbox.
type SandboxOptions struct {
	// Chain runs the new sandbox's ADD and the old one's DEL (default: the
	// chain the pod was attached with). Env.PlainChain leaves the agent
	// out, as a runtime whose conflist lost our entry does.
	Chain *Chain
	// SameIP asks host-local for the pod's current first address again
	// (CNI_ARGS IP=), as for a pod with a static address.
	SameIP bool
	// KeepOld leaves the old sandbox running (no DEL, netns and pause
	// process kept), as a runtime that removes it later does; the caller
	// tears it down with TeardownSandbox. Not with SameIP (the old
	// sandbox still holds the address).
	KeepOld bool
}

// RecreateSandbox does what the container runtime and kubelet do when a
// pod's sandbox dies and is made again: the old sandbox is torn down (CNI DEL
// through o.Chain, pause process and cgroup, netns), unless o.KeepOld; a new
// one is attached (netns, pause process, CNI ADD through o.Chain); then the
// pod's status is updated as kubelet does (new IPs, PodReadyToStartContainers
// with a new lastTransitionTime). p then describes the new sandbox; the old
// one is returned (with o.KeepOld still there, tracked until
// TeardownSandbox).
func (e *Env) RecreateSandbox(ctx context.Context, p *Pod, o SandboxOptions) (*Pod, error) {
	if o.SameIP && o.KeepOld {
		return nil, errors.New("RecreateSandbox: SameIP and KeepOld exclude each other")
	}
	chain := o.Chain
	if chain == nil {
		chain = p.chain
	}
	obj, err := e.CP.Admin.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("recreate sandbox of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	old := &Pod{}
	*old = *p
	old.Object = nil
	if !o.KeepOld {
		old.chain = chain
		if err := old.teardown(ctx); err != nil {
			return nil, fmt.Errorf("recreate sandbox of pod %s/%s: tear the old one down: %w", p.Namespace, p.Name, err)
		}
		e.untrack(p)
	}
	var ip netip.Addr
	if o.SameIP {
		ip = p.IP()
	}
	nu, err := e.attach(ctx, obj, chain, ip, p.RuntimeUID)
	if err != nil {
		return old, fmt.Errorf("recreate sandbox of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	if o.KeepOld {
		// The old sandbox stays tracked as its own Pod; p becomes the new.
		e.untrack(p)
		e.track(old)
	}
	e.untrack(nu)
	*p = *nu
	e.track(p)
	if p.Object, err = e.MarkRunning(ctx, obj, p.IPs); err != nil {
		return old, err
	}
	return old, nil
}

// TeardownSandbox removes a sandbox RecreateSandbox kept (KeepOld), as the
// runtime's late cleanup does: CNI DEL through chain (nil: the one it was
// made with), pause process, netns. With removeNetnsFirst the netns is
// removed before the DEL, so the DEL names a path that no longer exists.
func (e *Env) TeardownSandbox(ctx context.Context, old *Pod, chain *Chain, removeNetnsFirst bool) error {
	defer e.untrack(old)
	if chain != nil {
		old.chain = chain
	}
	var errs []error
	if removeNetnsFirst {
		errs = append(errs, old.stopSandbox())
		if old.Netns != nil {
			errs = append(errs, DeleteNetns(old.Netns))
			old.Netns = nil
		}
		if _, err := os.Stat(old.NetnsPath); !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("netns %s still there after removal (%v)", old.NetnsPath, err))
		}
		errs = append(errs, old.chain.Del(ctx, old.attachment()))
	}
	errs = append(errs, old.teardown(ctx))
	return errors.Join(errs...)
}

// DeletePod tears a pod down as the kubelet does: CNI DEL, stop the sandbox's
// pause process and remove its cgroup, remove the netns, delete the Pod object
// (grace 0). Every step runs even when an earlier one fails; the errors are
// joined. Deleting twice is fine.
func (e *Env) DeletePod(ctx context.Context, p *Pod) error {
	errs := []error{p.teardown(ctx)}
	err := e.CP.Admin.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	if err != nil && !apierrors.IsNotFound(err) {
		errs = append(errs, fmt.Errorf("delete pod %s/%s: %w", p.Namespace, p.Name, err))
	}
	e.untrack(p)
	return errors.Join(errs...)
}

// teardown undoes AttachPod: CNI DEL, sandbox process and cgroup, netns.
func (p *Pod) teardown(ctx context.Context) error {
	var errs []error
	if p.NetnsPath != "" && p.chain != nil && p.Netns != nil {
		if err := p.chain.Del(ctx, p.attachment()); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, p.stopSandbox())
	if p.Netns != nil {
		if err := DeleteNetns(p.Netns); err != nil {
			errs = append(errs, err)
		}
		p.Netns = nil
	}
	return errors.Join(errs...)
}

// Dial connects from inside the pod's network namespace: the socket is
// created on a thread switched into the netns, so it belongs there (routing,
// in-pod iptables rules) for its whole life. addr must be an IP:port (no DNS
// lookups from the node netns).
func (p *Pod) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	if p.Netns == nil {
		return nil, fmt.Errorf("pod %s/%s has no netns", p.Namespace, p.Name)
	}
	var conn net.Conn
	err := p.Netns.Do(func(ns.NetNS) error {
		var d net.Dialer
		var err error
		conn, err = d.DialContext(ctx, network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial %s %s from pod %s/%s: %w", network, addr, p.Namespace, p.Name, err)
	}
	return conn, nil
}

// Listen opens a listener inside the pod's network namespace.
func (p *Pod) Listen(network, addr string) (net.Listener, error) {
	if p.Netns == nil {
		return nil, fmt.Errorf("pod %s/%s has no netns", p.Namespace, p.Name)
	}
	var l net.Listener
	err := p.Netns.Do(func(ns.NetNS) error {
		var err error
		l, err = net.Listen(network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen %s %s in pod %s/%s: %w", network, addr, p.Namespace, p.Name, err)
	}
	return l, nil
}

// Do runs f on a thread inside the pod's network namespace.
func (p *Pod) Do(f func() error) error {
	if p.Netns == nil {
		return fmt.Errorf("pod %s/%s has no netns", p.Namespace, p.Name)
	}
	return p.Netns.Do(func(ns.NetNS) error { return f() })
}

func (e *Env) track(p *Pod) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.pods[p] = struct{}{}
}

func (e *Env) untrack(p *Pod) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.pods, p)
}

func (e *Env) trackedPods() []*Pod {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*Pod
	for p := range e.pods {
		out = append(out, p)
	}
	return out
}
