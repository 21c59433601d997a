//go:build e2e

package e2e

// End-to-end tests of "Ready means meshed for every pod": the
// shipped pod admission policies (deploy/pod-admission.yaml) on the real
// kube-apiserver, judged with the same case tables as the Go code
// (admission/cases), and the agent's no-deadlock rule for gated pods it
// does not enroll.

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/cases"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestAdmissionGateNeverDeadlocks: pods that carry the readiness gate but
// that the agent does not enroll — labelled `none` after admission added
// the gate, gated by hand in a namespace outside the mesh, sidecar-injected
// after the gate was added — get True/NotInMesh from the agent, so kubelet
// can turn them Ready. A pod without the gate and outside the mesh gets no
// condition at all (the agent does not write to pods it has no business
// with).
func TestAdmissionGateNeverDeadlocks(t *testing.T) {
	s := newScenario(t, "gate-amb", within(3*time.Minute))
	ctx, ambientNS := s.ctx, s.ns
	plainNS := uniqueNS("gate-plain")
	createNamespace(t, ctx, plainNS, false)

	optedOut := createPod(t, ctx, e2eenv.PodSpec{Namespace: ambientNS, Name: "opted-out", Labels: map[string]string{labelMode: "none"}, Mutate: gated})
	plain := createPod(t, ctx, e2eenv.PodSpec{Namespace: plainNS, Name: "gated-plain", Mutate: gated})
	sidecar := createPod(t, ctx, e2eenv.PodSpec{Namespace: ambientNS, Name: "sidecar", Annotations: map[string]string{annSidecar: "{}"}, Mutate: gated})
	ungated := createPod(t, ctx, e2eenv.PodSpec{Namespace: plainNS, Name: "ungated"})
	start := time.Now()
	for _, p := range []*e2eenv.Pod{optedOut, plain, sidecar} {
		o := waitPod(t, ctx, p, "condition True/NotInMesh", podConditionIs(corev1.ConditionTrue, agent.ReasonNotInMesh))
		if _, has := o.Annotations[annRedirect]; has {
			t.Errorf("%s: annotated %q though never enrolled", p.Name, o.Annotations[annRedirect])
		}
		if !kubeletWouldBeReady(o) {
			t.Errorf("%s: kubelet would keep it NotReady: conditions %+v", p.Name, o.Status.Conditions)
		}
	}
	t.Logf("gated pods out of the mesh: True/NotInMesh within %s of the last creation", time.Since(start).Round(time.Millisecond))
	// The agent synced the ungated pod too (same namespace as gated-plain,
	// created last): it must have left it alone.
	o, err := testEnv.CP.Admin.CoreV1().Pods(plainNS).Get(ctx, ungated.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if c := enrolledCondition(o); c != nil {
		t.Errorf("ungated pod outside the mesh got condition %+v", c)
	}
}

// podAdmission is the shipped pod admission (deploy/pod-admission.yaml and
// the agent's ConfigMap, the policy's param) as kustomize renders deploy/.
type podAdmission struct {
	objs      []*unstructured.Unstructured // policies and bindings
	configMap *unstructured.Unstructured
	// active reports whether either policy still acts (probe pods).
	active func(context.Context) bool
}

// remove deletes the policies, bindings and ConfigMap and waits until
// neither policy acts any more (idempotent).
func (pa podAdmission) remove(t *testing.T, ctx context.Context) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	for _, o := range append(slices.Clone(pa.objs), pa.configMap) {
		if err := deleteObject(ctx, dyn, mapper, o); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	testutil.Eventually(t, "pod admission policies no longer acting", time.Minute, func() bool { return !pa.active(ctx) })
}

func renderPodAdmission(t *testing.T) podAdmission {
	t.Helper()
	var pa podAdmission
	for _, o := range renderDeploy(t) {
		switch {
		case o.GetKind() == "ConfigMap" && o.GetName() == admission.ConfigMapName:
			pa.configMap = o
		case o.GetName() == admission.MutatingPolicyName || o.GetName() == admission.ValidatingPolicyName:
			pa.objs = append(pa.objs, o)
		}
	}
	if len(pa.objs) != 4 || pa.configMap == nil {
		t.Fatalf("deploy/ renders %d pod admission objects (want the two policies and their bindings) and ConfigMap %v", len(pa.objs), pa.configMap != nil)
	}
	return pa
}

// installPodAdmission creates the shipped pod admission policies and the
// agent's ConfigMap in the e2e apiserver and waits until both policies act
// (a pod of an ambient namespace gets the gate, a bad annotation is
// refused). At the end of the test everything is deleted again, and the
// test waits until neither acts any more (other tests run without them).
func installPodAdmission(t *testing.T, ctx context.Context) podAdmission {
	t.Helper()
	pa := renderPodAdmission(t)
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	probeNS := uniqueNS("adm-probe")
	createNamespace(t, ctx, probeNS, true)
	gating := func(ctx context.Context) bool {
		p, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: probeNS}})
		return err == nil && len(p.Spec.ReadinessGates) == 1
	}
	validating := func(ctx context.Context) bool {
		_, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: probeNS, Annotations: map[string]string{annDNSCapture: "maybe"}}})
		return err != nil
	}
	pa.active = func(ctx context.Context) bool { return gating(ctx) || validating(ctx) }
	t.Cleanup(func() { pa.remove(t, context.Background()) })
	for _, o := range append([]*unstructured.Unstructured{pa.configMap}, pa.objs...) {
		if err := serverSideApply(ctx, dyn, mapper, o, false); err != nil {
			t.Fatalf("create %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	start := time.Now()
	testutil.Until(t, ctx, "the shipped policies in force", func() bool { return gating(ctx) && validating(ctx) })
	t.Logf("pod admission policies in force %s after creation", time.Since(start).Round(time.Millisecond))
	return pa
}

// setAgentConfig replaces the data of the agent's ConfigMap (the policy's
// param) with the shipped data overridden by over.
func (pa podAdmission) setAgentConfig(t *testing.T, ctx context.Context, over map[string]string) {
	t.Helper()
	cm := pa.configMap.DeepCopy()
	data, _, _ := unstructured.NestedStringMap(cm.Object, "data")
	maps.Copy(data, over)
	if err := unstructured.SetNestedStringMap(cm.Object, data, "data"); err != nil {
		t.Fatal(err)
	}
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	if err := serverSideApply(ctx, dyn, mapper, cm, false); err != nil {
		t.Fatalf("update ConfigMap: %v", err)
	}
}

// dryRunPod creates pod (server-side dry run, as the admin) and returns it
// as admission left it. A name and a container are added when missing; the
// namespace's default service account is created if needed.
func dryRunPod(ctx context.Context, pod *corev1.Pod) (*corev1.Pod, error) {
	p := pod.DeepCopy()
	if p.Name == "" {
		p.Name = "case"
	}
	if len(p.Spec.Containers) == 0 {
		p.Spec.Containers = []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}
	}
	if err := testEnv.EnsureServiceAccount(ctx, p.Namespace, "default"); err != nil {
		return nil, err
	}
	return testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
}

func gateTypes(p *corev1.Pod) []string {
	out := []string{}
	for _, g := range p.Spec.ReadinessGates {
		out = append(out, string(g.ConditionType))
	}
	return out
}

// ensureTableNamespaces creates the table's namespaces with their labels;
// those that exist (kube-system, istio-system, or created by another table
// test of this run) must carry exactly the table's mesh labels. They are
// kept for the run: the e2e control plane has no namespace controller, so a
// deleted namespace would stay Terminating and refuse the next table
// test's pods.
func ensureTableNamespaces(t *testing.T, ctx context.Context, e cases.Enrollment) {
	t.Helper()
	for _, n := range e.Namespaces {
		got, err := testEnv.CP.Admin.CoreV1().Namespaces().Get(ctx, n.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if _, err := testEnv.CreateNamespace(ctx, n.Name, n.Labels); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{labelMode, admission.LabelReadinessGate} {
			if got.Labels[k] != n.Labels[k] {
				t.Fatalf("namespace %s exists with %s=%q, the table says %q", n.Name, k, got.Labels[k], n.Labels[k])
			}
		}
	}
}

// TestAdmissionPolicyTable runs admission/cases/enrollment.yaml — the table
// the Go policy passes in admission/cases — against the shipped
// MutatingAdmissionPolicy on the real kube-apiserver: every pod comes back
// from a (dry-run) create with exactly the table's readiness gates. Cases
// with settings change the agent's ConfigMap (the policy's param) first;
// consecutive cases with the same settings form a group, and a group is
// judged when one pass over it matches (the table test in admission/cases
// makes sure each group can be told apart from the one before, so a param
// the apiserver has not picked up yet cannot pass for the new one).
func TestAdmissionPolicyTable(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	e, err := cases.LoadEnrollment()
	if err != nil {
		t.Fatal(err)
	}
	ensureTableNamespaces(t, ctx, e)
	pa := installPodAdmission(t, ctx)
	for _, g := range cases.Groups(e.Cases) {
		if len(g[0].Settings) > 0 {
			pa.setAgentConfig(t, ctx, g[0].Settings)
		}
		start := time.Now()
		var mismatch []string
		judge := func(ctx context.Context) (bool, error) {
			mismatch = mismatch[:0]
			for _, c := range g {
				p, err := dryRunPod(ctx, &c.Pod)
				if err != nil {
					return false, fmt.Errorf("%s: create: %w", c.Name, err)
				}
				if got := gateTypes(p); !slices.Equal(got, c.Gates) {
					mismatch = append(mismatch, fmt.Sprintf("%s: gates %q, table says %q", c.Name, got, c.Gates))
				}
			}
			return len(mismatch) == 0, nil
		}
		var err error
		if len(g[0].Settings) == 0 {
			_, err = judge(ctx)
		} else {
			// The apiserver picks up the new param asynchronously.
			err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, judge)
			if wait.Interrupted(err) {
				err = nil // the mismatches say it
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mismatch {
			t.Error(m)
		}
		if len(g[0].Settings) > 0 && len(mismatch) == 0 {
			t.Logf("settings %v: %d cases agree (%s after the ConfigMap update)", g[0].Settings, len(g), time.Since(start).Round(time.Millisecond))
		}
	}
	t.Logf("%d cases: the shipped policy and the Go policy agree", len(e.Cases))
}

// TestAdmissionAnnotationTable runs admission/cases/annotations.json — the
// table the agent's parsing is judged by in admission/cases — against the
// shipped ValidatingAdmissionPolicy: a (dry-run) pod create with the
// annotation is accepted exactly for the valid values, and a refusal names
// the annotation, the value and the accepted values. On update only a new
// or changed value is judged: a pod created with a bad value before the
// policy existed can still be relabelled, not given another bad value.
func TestAdmissionAnnotationTable(t *testing.T) {
	s := newScenario(t, "adm-ann", within(3*time.Minute), withoutZtunnel(), withoutAgent())
	ctx, nsName := s.ctx, s.ns
	// Before the policy: a pod with a value the agent refuses (as an old
	// cluster may hold).
	old, err := testEnv.CP.Admin.CoreV1().Pods(nsName).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "old", Annotations: map[string]string{annDNSCapture: "maybe"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = testEnv.CP.Admin.CoreV1().Pods(nsName).Delete(context.Background(), old.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	installPodAdmission(t, ctx)
	cs, err := cases.LoadAnnotations()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cs {
		_, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: nsName, Annotations: c.Annotations}})
		switch {
		case c.Valid() && err != nil:
			t.Errorf("%s: refused: %v", c.Name, err)
		case !c.Valid() && err == nil:
			t.Errorf("%s: accepted; the agent calls %v invalid", c.Name, c.Invalid)
		case !c.Valid():
			msg := err.Error()
			named := false
			for _, a := range c.Invalid {
				named = named || strings.Contains(msg, "annotation "+a+" has invalid value")
			}
			if !apierrors.IsInvalid(err) || !strings.Contains(msg, admission.ValidatingPolicyName) || !named || !strings.Contains(msg, "accepted values are") {
				t.Errorf("%s: refusal %q must be Invalid and name the policy, an invalid annotation (%v) and the accepted values", c.Name, msg, c.Invalid)
			}
		}
	}
	t.Logf("%d annotation cases: the shipped policy agrees with the table", len(cs))
	if _, err := dryRunPod(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: nsName, Annotations: map[string]string{annDNSCapture: "maybe"}}}); err != nil {
		t.Logf("kubectl apply of dns-capture=maybe would print: %v", err)
	}

	patch := func(body string) error {
		_, err := testEnv.CP.Admin.CoreV1().Pods(nsName).Patch(ctx, old.Name, types.MergePatchType, []byte(body), metav1.PatchOptions{})
		return err
	}
	if err := patch(`{"metadata":{"labels":{"team":"a"}}}`); err != nil {
		t.Errorf("relabelling a pod whose bad annotation predates the policy: %v", err)
	}
	if err := patch(fmt.Sprintf(`{"metadata":{"annotations":{%q:"perhaps"}}}`, annDNSCapture)); !apierrors.IsInvalid(err) {
		t.Errorf("changing the bad value to another bad one: %v, want refused", err)
	}
	if err := patch(fmt.Sprintf(`{"metadata":{"annotations":{%q:"tap0 -j ACCEPT"}}}`, "istio.io/reroute-virtual-interfaces")); !apierrors.IsInvalid(err) {
		t.Errorf("adding a bad reroute-virtual-interfaces on update: %v, want refused", err)
	}
	if err := patch(fmt.Sprintf(`{"metadata":{"annotations":{%q:"false"}}}`, annDNSCapture)); err != nil {
		t.Errorf("fixing the value: %v", err)
	}
}

// injectManifest runs `bin/ambientd inject` on manifest with args.
func injectManifest(t *testing.T, ctx context.Context, manifest string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, testEnv.Bins.Agent, append([]string{"inject"}, args...)...)
	cmd.Stdin = strings.NewReader(manifest)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ambientd inject: %v\n%s", err, stderr.String())
	}
	t.Logf("%s", strings.TrimSpace(stderr.String()))
	return string(out)
}

// podsOf decodes the Pod documents of a YAML stream.
func podsOf(t *testing.T, manifest string) map[string]*corev1.Pod {
	t.Helper()
	out := map[string]*corev1.Pod{}
	for _, doc := range strings.Split(manifest, "\n---\n") {
		var p corev1.Pod
		if err := yaml.UnmarshalStrict([]byte(doc), &p); err != nil {
			t.Fatalf("decode %q: %v", doc, err)
		}
		out[p.Name] = &p
	}
	return out
}

// TestAdmissionInjectLikeAdmission: the same pod manifests (no gate written
// in them) go into the mesh once through the shipped admission policy and
// once through `ambientd inject` with the policy removed (an older
// cluster): the pods come out with the same readiness gates, are held
// NotReady alike while no ztunnel takes them, and turn ready alike once the
// emulator acks them. The out-of-mesh and opted-out pods get no gate either
// way.
func TestAdmissionInjectLikeAdmission(t *testing.T) {
	s := newScenario(t, "adm-inject", withoutZtunnel(), agentArgs("--retry-base-delay=10m", "--retry-max-delay=10m"))
	ctx, nsName := s.ctx, s.ns
	manifest := strings.Join([]string{
		"apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec:\n  readinessGates: [{conditionType: example.com/lb}]\n  containers: [{name: c, image: x}]",
		"apiVersion: v1\nkind: Pod\nmetadata: {name: batch, labels: {istio.io/dataplane-mode: none}}\nspec: {containers: [{name: c, image: x}]}",
		"apiVersion: v1\nkind: Pod\nmetadata: {name: quiet, labels: {ambient.istio.io/readiness-gate: \"false\"}}\nspec: {containers: [{name: c, image: x}]}",
	}, "\n---\n")
	type path struct {
		name string
		pods map[string]*corev1.Pod
	}
	create := func(prefix string, pods map[string]*corev1.Pod) map[string]*e2eenv.Pod {
		out := map[string]*e2eenv.Pod{}
		for name, p := range pods {
			out[name] = createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: prefix + name, Labels: p.Labels, Mutate: func(o *corev1.Pod) {
				o.Spec.ReadinessGates = p.Spec.ReadinessGates
			}})
		}
		return out
	}

	// Through admission.
	pa := installPodAdmission(t, ctx)
	viaPolicy := create("policy-", podsOf(t, manifest))
	// Through inject, with the policy removed (deleted the way the
	// cleanup does it, and waited for).
	pa.remove(t, ctx)
	injected := injectManifest(t, ctx, manifest, "-n", nsName, "--cluster", "--kubeconfig", testEnv.CP.AdminKubeconfig)
	viaInject := create("inject-", podsOf(t, injected))

	objects := func(ps map[string]*e2eenv.Pod, cond func(*corev1.Pod) bool, what string) map[string]*corev1.Pod {
		out := map[string]*corev1.Pod{}
		for name, p := range ps {
			out[name] = waitPod(t, ctx, p, what, cond)
		}
		return out
	}
	held := func(p *corev1.Pod) bool {
		if p.Labels[labelMode] == "none" {
			return true
		}
		return podConditionIs(corev1.ConditionFalse, agent.ReasonZtunnelUnavailable)(p)
	}
	a, b := objects(viaPolicy, held, "pending without ztunnel"), objects(viaInject, held, "pending without ztunnel")
	for name := range a {
		ga, gb := gateTypes(a[name]), gateTypes(b[name])
		if !slices.Equal(ga, gb) {
			t.Errorf("%s: gates through admission %q, through inject %q", name, ga, gb)
		}
		ra, rb := kubeletWouldBeReadyExcept(a[name], "example.com/lb"), kubeletWouldBeReadyExcept(b[name], "example.com/lb")
		if ra != rb {
			t.Errorf("%s: ready through admission %v, through inject %v", name, ra, rb)
		}
		t.Logf("%s: gates %q; would be ready while pending (the load balancer's gate aside): %v", name, ga, ra)
	}
	if want := []string{"example.com/lb", podCondition}; !slices.Equal(gateTypes(a["web"]), want) || kubeletWouldBeReadyExcept(a["web"], "example.com/lb") {
		t.Errorf("web: gates %q (want %q), would be ready %v while pending", gateTypes(a["web"]), want, kubeletWouldBeReadyExcept(a["web"], "example.com/lb"))
	}
	for _, n := range []string{"batch", "quiet"} {
		if len(gateTypes(a[n])) != 0 {
			t.Errorf("%s got gates %q", n, gateTypes(a[n]))
		}
	}
	startEmulator(t, ctx, "inject")
	enabled := func(p *corev1.Pod) bool {
		if p.Labels[labelMode] == "none" {
			return true
		}
		return podConditionIs(corev1.ConditionTrue, agent.ReasonEnrolled)(p)
	}
	a, b = objects(viaPolicy, enabled, "True/Enrolled"), objects(viaInject, enabled, "True/Enrolled")
	for name := range a {
		if !kubeletWouldBeReadyExcept(a[name], "example.com/lb") || !kubeletWouldBeReadyExcept(b[name], "example.com/lb") {
			t.Errorf("%s: not ready once enrolled: %+v / %+v", name, a[name].Status.Conditions, b[name].Status.Conditions)
		}
	}
}

// kubeletWouldBeReadyExcept is kubeletWouldBeReady ignoring the gate of
// another controller (nobody runs it here).
func kubeletWouldBeReadyExcept(p *corev1.Pod, other corev1.PodConditionType) bool {
	q := p.DeepCopy()
	q.Spec.ReadinessGates = slices.DeleteFunc(q.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool { return g.ConditionType == other })
	return kubeletWouldBeReady(q)
}
