//go:build e2enode

package e2enode

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/admission/check"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// gateWatch records, for every version of every pod of a namespace, whether
// it was Ready while its gate's condition was not True (never allowed).
type gateWatch struct {
	mu          sync.Mutex
	readyEarly  []string
	readyAt     map[string]time.Time
	enrolledAt  map[string]time.Time
	createdSeen map[string]time.Time
}

func watchGates(t *testing.T, ctx context.Context, ns string) *gateWatch {
	t.Helper()
	gw := &gateWatch{readyAt: map[string]time.Time{}, enrolledAt: map[string]time.Time{}, createdSeen: map[string]time.Time{}}
	observe := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			return
		}
		now := time.Now()
		c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
		gated := slices.ContainsFunc(p.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool { return g.ConditionType == nodeenv.EnrolledCondition })
		gw.mu.Lock()
		defer gw.mu.Unlock()
		if _, ok := gw.createdSeen[p.Name]; !ok {
			gw.createdSeen[p.Name] = now
		}
		if c != nil && c.Status == corev1.ConditionTrue && gw.enrolledAt[p.Name].IsZero() {
			gw.enrolledAt[p.Name] = now
		}
		if podReady(p) {
			if gw.readyAt[p.Name].IsZero() {
				gw.readyAt[p.Name] = now
			}
			if gated && (c == nil || c.Status != corev1.ConditionTrue) {
				gw.readyEarly = append(gw.readyEarly, fmt.Sprintf("%s (resourceVersion %s): Ready with condition %+v", p.Name, p.ResourceVersion, c))
			}
		}
	}
	observePods(t, ctx, ns, observe)
	return gw
}

// kubectlApply applies objects (a YAML stream written to a file) with the
// real kubectl, as a user would.
func kubectlApply(t *testing.T, ctx context.Context, objs ...any) (string, error) {
	t.Helper()
	var docs []string
	for _, o := range objs {
		b, err := yaml.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, string(b))
	}
	path := filepath.Join(t.TempDir(), "manifest.yaml")
	if err := os.WriteFile(path, []byte(strings.Join(docs, "---\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	return node.Kubectl(ctx, "apply", "-f", path)
}

func hasGate(p *corev1.Pod) bool {
	return slices.ContainsFunc(p.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool { return g.ConditionType == nodeenv.EnrolledCondition })
}

// admissionGatesFromPolicy: the real-node "must show" for gate
// injection. With deploy/ applied (its MutatingAdmissionPolicy and
// ValidatingAdmissionPolicy came with `kubectl apply -k`), or the chart
// installed (before Kubernetes 1.36 its webhook adds the gate instead of the
// MutatingAdmissionPolicy: r.gate), `kubectl apply` of a Deployment
// WITHOUT a readiness gate into an ambient namespace: its
// pods carry the gate, run (containers ready: no probe) but stay NotReady
// while no ztunnel is there, and turn Ready only after the emulator acked
// them — no pod version is ever Ready with the condition not True. A pod in
// a plain namespace, a hostNetwork pod and a gate-opted-out pod get no gate
// and are Ready (the opted-out one while still pending: that is what
// opting out means). A pod with `ambient.istio.io/dns-capture: maybe` is refused by
// kubectl apply with a message naming the annotation. A gated pod switched
// to `none` before the agent enrolled it (held by a scheduling gate while
// relabelled) gets True/NotInMesh and turns Ready, never sent to ztunnel.
// Finally `ambientd check` (kubeconfig only) says of every pod what the API
// shows.
func (r *agentRun) admissionGatesFromPolicy(t *testing.T, ctx context.Context) {
	if r.em != nil {
		if err := r.em.Stop(5 * time.Second); err != nil {
			t.Logf("emulator stop: %v", err)
		}
		r.em = nil
	}
	ns := ambientNamespace(t, ctx, "adm-shop")
	plain := namespace(t, ctx, "adm-plain")
	gw := watchGates(t, ctx, ns)

	// No readiness probe in the Deployment's and the opted-out pod's
	// containers: their containers are ready at once, so only the gate can
	// hold them NotReady (a probe would fail too while pending: kubelet's
	// probes pass the capture only once ztunnel acked the pod).
	noProbe := nodeenv.AppPodSpec()
	noProbe.Containers[0].ReadinessProbe = nil
	replicas := int32(2)
	sel := map[string]string{"app": "web"}
	dep := &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas, Selector: &metav1.LabelSelector{MatchLabels: sel},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: sel}, Spec: noProbe},
		},
	}
	pod := func(namespace, name string, labels map[string]string, mut func(*corev1.Pod)) *corev1.Pod {
		p := nodeenv.AppPod(name)
		p.TypeMeta = metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"}
		p.Namespace, p.Labels = namespace, labels
		if mut != nil {
			mut(p)
		}
		return p
	}
	plainPod := pod(plain, "plain", nil, nil)
	hostPod := pod(ns, "host", nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true })
	optedOut := pod(ns, "opted-out", map[string]string{"ambient.istio.io/readiness-gate": "false"}, func(p *corev1.Pod) { p.Spec = *noProbe.DeepCopy() })
	start := time.Now()
	if out, err := kubectlApply(t, ctx, dep, plainPod, hostPod, optedOut); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("kubectl apply (no readiness gate in any manifest):\n%s", strings.TrimSpace(out))
	}
	// An annotation the agent would refuse never gets past kubectl.
	bad := pod(ns, "bad", nil, func(p *corev1.Pod) { p.Annotations = map[string]string{podmeta.AnnotationDNSCapture: "maybe"} })
	out, err := kubectlApply(t, ctx, bad)
	if err == nil || !strings.Contains(out, "ambient.istio.io/dns-capture") || !strings.Contains(out, `"maybe"`) || !strings.Contains(out, "accepted values") {
		t.Errorf("kubectl apply of dns-capture=maybe: err %v, output %q; want refused naming the annotation and the accepted values", err, out)
	} else {
		t.Logf("kubectl apply of dns-capture=maybe refused: %s", strings.TrimSpace(out))
	}

	// The Deployment's pods: gated by the policy, running, not Ready.
	list := func() []corev1.Pod {
		l, err := node.Env.CP.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
		if err != nil {
			t.Fatal(err)
		}
		return l.Items
	}
	var webs []string
	if err := nodeenv.Poll(ctx, "web pods running, gated, held pending without ztunnel", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		webs = webs[:0]
		for _, p := range list() {
			c := nodeenv.Condition(&p, nodeenv.EnrolledCondition)
			if !hasGate(&p) {
				return false, fmt.Errorf("%s has no readiness gate: %v", p.Name, p.Spec.ReadinessGates)
			}
			if !containerReadyFor(&p, 3*time.Second) || c == nil || c.Status != corev1.ConditionFalse || c.Reason != "ZtunnelUnavailable" {
				return false, nil
			}
			webs = append(webs, p.Name)
		}
		return len(webs) == 2, nil
	}); err != nil {
		t.Fatalf("%v; pods: %v", err, describePods(list()))
	}
	for _, p := range list() {
		if podReady(&p) {
			t.Errorf("%s Ready without ztunnel: %s", p.Name, describe(&p))
		}
	}
	t.Logf("web pods gated by the admission %s, containers ready 3+ s (no probe), still NotReady: %v", r.gateMechanism(), describePods(list()))
	for _, p := range []*corev1.Pod{plainPod, hostPod, optedOut} {
		got, err := waitPod(ctx, p.Namespace, p.Name, podReady)
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Spec.ReadinessGates) != 0 {
			t.Errorf("%s/%s got readiness gates %v", p.Namespace, p.Name, got.Spec.ReadinessGates)
		}
	}

	// ztunnel comes: Ready only after the ack.
	emStart := time.Now()
	r.em, err = node.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range webs {
		p, err := waitPod(ctx, ns, name, podReady)
		if err != nil {
			t.Fatal(err)
		}
		r.waitEmu(t, ctx, "Add acked for "+name, func(s ztunnelemu.State) bool { _, ok := s.Workload(string(p.UID)); return ok })
		gw.mu.Lock()
		ready, enrolled := gw.readyAt[name], gw.enrolledAt[name]
		gw.mu.Unlock()
		if p.Annotations[podmeta.AnnotationRedirection] != "enabled" || enrolled.IsZero() || ready.Before(enrolled) {
			t.Errorf("%s: annotation %q, enrolled seen at %v, Ready at %v: Ready must follow the ack", name, p.Annotations[podmeta.AnnotationRedirection], enrolled, ready)
		}
		t.Logf("%s: ztunnel started -> condition True %s -> Ready %s", name, enrolled.Sub(emStart).Round(time.Millisecond), ready.Sub(emStart).Round(time.Millisecond))
	}

	// Labelled `none` after admission gated it, before the agent saw it.
	held := pod(ns, "switched", nil, func(p *corev1.Pod) {
		p.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "ambientd.test/hold"}}
	})
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, held, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !hasGate(created) {
		t.Fatalf("switched: no gate from the admission %s: %v", r.gateMechanism(), created.Spec.ReadinessGates)
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"none"}}}`, podmeta.LabelDataplaneMode)
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Patch(ctx, "switched", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Patch(ctx, "switched", types.JSONPatchType, []byte(`[{"op":"remove","path":"/spec/schedulingGates"}]`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	sw, err := waitPod(ctx, ns, "switched", podReady)
	if err != nil {
		t.Fatal(err)
	}
	if c := nodeenv.Condition(sw, nodeenv.EnrolledCondition); c == nil || c.Status != corev1.ConditionTrue || c.Reason != "NotInMesh" || !hasGate(sw) {
		t.Errorf("switched: gated %v, condition %+v; want True/NotInMesh", hasGate(sw), c)
	}
	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	if n := len(opsFor(st, string(sw.UID))); n != 0 {
		t.Errorf("switched: ztunnel got %d requests for a pod out of the mesh", n)
	}
	t.Logf("switched to none before enrollment: %s", describe(sw))

	gw.mu.Lock()
	for _, e := range gw.readyEarly {
		t.Errorf("Ready before the gate's condition was True: %s", e)
	}
	gw.mu.Unlock()
	// The agent pod turns Ready when kubelet's next readiness probe sees the
	// new ztunnel; check reports that pod's Ready, so wait for it first.
	if err := nodeenv.Poll(ctx, "agent pod Ready after ztunnel came", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return p != nil && podReady(p), err
	}); err != nil {
		t.Fatal(err)
	}
	r.checkTellsTheTruth(t, ctx, ns, plain)
	t.Logf("scenario took %s", time.Since(start).Round(time.Millisecond))
}

// checkTellsTheTruth runs `ambientd check -o json` (the admin's kubeconfig,
// nothing else) on the namespaces and compares every pod it reports with
// the API object.
func (r *agentRun) checkTellsTheTruth(t *testing.T, ctx context.Context, namespaces ...string) {
	for _, ns := range namespaces {
		cmd := exec.CommandContext(ctx, node.Env.Bins.Agent, "check", "-n", ns, "-o", "json", "--kubeconfig", node.Env.CP.AdminKubeconfig)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("ambientd check -n %s: %v", ns, err)
		}
		var rep check.Report
		if err := json.Unmarshal(out, &rep); err != nil {
			t.Fatalf("ambientd check output: %v\n%s", err, out)
		}
		if gate := map[string]bool{"policy": rep.Admission.GatePolicy, "webhook": rep.Admission.GateWebhook}; !gate[r.gateMechanism()] || !rep.Admission.AnnotationPolicy {
			t.Errorf("check: admission %+v; installed: the gate's %s and the annotation policy", rep.Admission, r.gateMechanism())
		}
		list, err := node.Env.CP.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Pods) != len(list.Items) {
			t.Errorf("check -n %s reports %d pods, the API has %d", ns, len(rep.Pods), len(list.Items))
		}
		api := map[string]*corev1.Pod{}
		for i := range list.Items {
			api[list.Items[i].Name] = &list.Items[i]
		}
		for _, cp := range rep.Pods {
			p := api[cp.Name]
			if p == nil {
				t.Errorf("check reports %s/%s, not in the API", ns, cp.Name)
				continue
			}
			var cond *check.Condition
			if c := nodeenv.Condition(p, nodeenv.EnrolledCondition); c != nil {
				cond = &check.Condition{Status: string(c.Status), Reason: c.Reason, Message: c.Message}
			}
			wantMesh := ns != namespaces[len(namespaces)-1] && !p.Spec.HostNetwork && p.Labels[podmeta.LabelDataplaneMode] != "none"
			switch {
			case cp.Gated != hasGate(p), cp.Node != p.Spec.NodeName, cp.Redirection != p.Annotations[podmeta.AnnotationRedirection],
				cp.Ready != podReady(p), fmt.Sprint(cp.Condition) != fmt.Sprint(cond), cp.Enrolled != wantMesh,
				cp.Agent == nil || !cp.Agent.Serves || !cp.Agent.Ready || cp.Agent.NodeCondition != "True/Ready", cp.Attention:
				t.Errorf("check says %s/%s: %+v (agent %+v)\nthe API: gated %v, node %s, annotation %q, ready %v, condition %+v; in the mesh %v",
					ns, cp.Name, cp, cp.Agent, hasGate(p), p.Spec.NodeName, p.Annotations[podmeta.AnnotationRedirection], podReady(p), cond, wantMesh)
			}
		}
		table, _ := exec.CommandContext(ctx, node.Env.Bins.Agent, "check", "-n", ns, "--kubeconfig", node.Env.CP.AdminKubeconfig).CombinedOutput()
		t.Logf("ambientd check -n %s:\n%s", ns, table)
	}
}

// containerReadyFor reports whether the pod's containers are ready (kubelet
// probed the app successfully) and it has been running for d.
func containerReadyFor(p *corev1.Pod, d time.Duration) bool {
	if len(p.Status.ContainerStatuses) == 0 {
		return false
	}
	cs := p.Status.ContainerStatuses[0]
	return cs.Ready && cs.State.Running != nil && time.Since(cs.State.Running.StartedAt.Time) >= d+time.Second
}

func describePods(ps []corev1.Pod) []string {
	var out []string
	for i := range ps {
		out = append(out, describe(&ps[i]))
	}
	return out
}
