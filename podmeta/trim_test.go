package podmeta_test

import (
	"fmt"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/nodeagent/repair"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/policy"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
)

const (
	trimNode      = "node-a"
	trimCondition = corev1.PodConditionType(podmeta.ConditionEnrolled)
)

// readings is every answer the agent derives from a cached pod, through
// the readers other packages own: when Trim drops a field one of them
// reads, an answer changes and TestTrimKeepsWhatTheAgentReads fails.
func readings(t *testing.T, p *corev1.Pod) map[string]string {
	t.Helper()
	r := map[string]string{}
	pc := policy.DefaultConfig()
	for _, ns := range []map[string]string{nil, {podmeta.LabelDataplaneMode: podmeta.ModeAmbient}} {
		r[fmt.Sprintf("policy.Decide(ns %v)", ns)] = fmt.Sprintf("%+v", pc.Decide(p, ns))
	}
	capture, skip := policy.SidecarDecision(p)
	r["policy.SidecarDecision"] = fmt.Sprint(capture, skip)
	proxy := policy.ProxyInfo(p)
	r["policy.ProxyInfo"] = fmt.Sprintf("%v %v %s %v %v", proxy.Found, proxy.Env, proxy.Type, deref(proxy.UID), deref(proxy.GID))
	parsed, err := sidecar.Parse(p, podmeta.IPs(p))
	r["sidecar.Parse"] = fmt.Sprintf("%+v %v", parsed, err)
	uid, static := podmeta.StaticUID(p, trimNode)
	r["podmeta.StaticUID"] = fmt.Sprint(uid, static)
	r["podmeta.IPs"] = fmt.Sprint(podmeta.IPs(p))
	rc := repair.DefaultConfig()
	rc.Mode = repair.ModeOff
	rc.FieldSelector = "spec.serviceAccountName!=skipped,status.phase=Running,spec.nodeName=" + trimNode
	c, err := repair.New(rc, nil, nil, nil, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	r["repair.Broken"] = fmt.Sprint(c.Broken(p))
	// The agent's own readers (the readiness gate, its condition and the
	// sandbox's, the event's object reference) take these whole.
	r["readiness gates, phase"] = fmt.Sprintf("%+v %s", p.Spec.ReadinessGates, p.Status.Phase)
	for _, ct := range []corev1.PodConditionType{trimCondition, corev1.PodReadyToStartContainers} {
		for _, c := range p.Status.Conditions {
			if c.Type == ct {
				r["condition "+string(ct)] += fmt.Sprintf("%+v", c)
			}
		}
	}
	r["meta"] = fmt.Sprintf("%s/%s %s %s %v %v %v", p.Namespace, p.Name, p.UID, p.ResourceVersion, p.Labels, p.Annotations, p.OwnerReferences)
	return r
}

func deref(p *int64) string {
	if p == nil {
		return "nil"
	}
	return fmt.Sprint(*p)
}

// TestTrimKeepsWhatTheAgentReads runs every reader of a cached pod on
// Istio's injected pods (the golden cases: real injector output) and on the
// pod shapes the agent treats specially, trimmed and not: the answers must
// be the same, and the trimmed pod must hold none of the dropped weight.
func TestTrimKeepsWhatTheAgentReads(t *testing.T) {
	cases, err := istiogolden.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) == 0 {
		t.Fatal("no golden cases: the test would prove nothing")
	}
	pods := map[string]*corev1.Pod{}
	for _, c := range cases {
		p := c.Injected.DeepCopy()
		p.UID, p.Spec.NodeName, p.Status.Phase = "uid-"+types.UID(c.Name), trimNode, corev1.PodRunning
		for _, ip := range c.IPs() {
			p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip.String()})
		}
		pods["golden "+c.Name] = p
		// The same pod as the repair controller sees it after
		// istio-validation failed.
		broken := p.DeepCopy()
		broken.Status.InitContainerStatuses = []corev1.ContainerStatus{{
			Name:                 podmeta.ContainerValidation,
			State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
			LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Reason: "Error"}},
		}}
		pods["broken "+c.Name] = broken
	}
	yes := true
	pods["static mirror"] = &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "dns-node-a", Namespace: "ops", UID: "api-uid",
			Annotations:     map[string]string{podmeta.AnnotationConfigMirror: "0123abcd"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: trimNode, Controller: &yes}}},
		Spec:   corev1.PodSpec{NodeName: trimNode, Containers: []corev1.Container{{Name: "dns", Image: "dns:1"}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.7"},
	}
	pods["ambient, gated, host network"] = &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: "tenant", UID: "u-app", Labels: map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}},
		Spec: corev1.PodSpec{NodeName: trimNode, HostNetwork: true, ServiceAccountName: "app",
			ReadinessGates: []corev1.PodReadinessGate{{ConditionType: "ambient.istio.io/enrolled"}},
			Containers:     []corev1.Container{{Name: "app", Image: "app:1", Env: []corev1.EnvVar{{Name: "X", Value: "1"}}}},
			Volumes:        []corev1.Volume{{Name: "token"}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
			{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Unix(1000, 0)},
			{Type: trimCondition, Status: corev1.ConditionFalse, Reason: "ZtunnelUnavailable"},
			{Type: corev1.PodReady, Status: corev1.ConditionFalse, Message: "containers with unready status: [app]"}},
			ContainerStatuses: []corev1.ContainerStatus{{Name: "app", Image: "app:1"}}},
	}
	for name, full := range pods {
		t.Run(name, func(t *testing.T) {
			want := readings(t, full)
			before := full.DeepCopy()
			obj, err := podmeta.Trim(trimCondition, corev1.PodReadyToStartContainers)(full)
			if err != nil {
				t.Fatal(err)
			}
			got := obj.(*corev1.Pod)
			for k, w := range want {
				if g := readings(t, got)[k]; g != w {
					t.Errorf("%s: trimmed pod reads %s, the full pod %s", k, g, w)
				}
			}
			if !reflect.DeepEqual(before, full) {
				t.Error("Trim changed the object it was given")
			}
			if got.ManagedFields != nil || got.Spec.Volumes != nil || got.Status.ContainerStatuses != nil {
				t.Errorf("trimmed pod still holds managed fields, volumes or container statuses: %+v", got)
			}
			for _, c := range got.Status.Conditions {
				if c.Type != trimCondition && c.Type != corev1.PodReadyToStartContainers {
					t.Errorf("trimmed pod keeps condition %s, which no part of the agent reads", c.Type)
				}
			}
			for _, c := range append(got.Spec.InitContainers, got.Spec.Containers...) {
				if c.Image != "" || c.Resources.Requests != nil || c.VolumeMounts != nil {
					t.Errorf("container %s keeps its image, resources or mounts", c.Name)
				}
			}
		})
	}
}

// TestTrimOtherObjects: a namespace keeps what the policy reads (its labels)
// and what identifies it; its annotations (kubectl's last-applied
// configuration), spec and status go. A node keeps everything but its
// managed fields.
func TestTrimOtherObjects(t *testing.T) {
	now := metav1.Now()
	ns := &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: "tenant", UID: "u1", ResourceVersion: "42", DeletionTimestamp: &now,
			Labels:        map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient},
			Annotations:   map[string]string{"kubectl.kubernetes.io/last-applied-configuration": strings.Repeat("x", 4096)},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}},
		Spec:   corev1.NamespaceSpec{Finalizers: []corev1.FinalizerName{corev1.FinalizerKubernetes}},
		Status: corev1.NamespaceStatus{Phase: corev1.NamespaceActive},
	}
	obj, err := podmeta.Trim(trimCondition)(ns)
	if err != nil {
		t.Fatal(err)
	}
	got := obj.(*corev1.Namespace)
	want := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tenant", UID: "u1", ResourceVersion: "42", DeletionTimestamp: &now,
		Labels: map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("namespace after Trim: %+v, want %+v", got, want)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Annotations: map[string]string{"a": "b"},
		ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}}}
	obj, err = podmeta.Trim(trimCondition)(node)
	if err != nil {
		t.Fatal(err)
	}
	if n := obj.(*corev1.Node); n.ManagedFields != nil || n.Annotations["a"] != "b" {
		t.Errorf("node after Trim: %+v", n.ObjectMeta)
	}
}
