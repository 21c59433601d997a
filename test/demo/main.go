// Command demo is the main job (`make demo`): ambient enrollment on a real
// node. On this machine, inside a throwaway network and mount namespace
// (test/infra/nodeenv), it brings up etcd + kube-apiserver, containerd + runc,
// kubelet, kube-controller-manager and kube-scheduler; the node registers
// with the startup taint cni.istio.io/not-ready. Then, as an operator would:
//
//  1. `kubectl apply -k` of deploy/ (an overlay sets the locally built image,
//     imagePullPolicy: Never and the apiserver address: there is no registry
//     and no kube-proxy); the DaemonSet's pod installs ambientd-cni into the
//     node's conflist and reports not ready: no ztunnel yet;
//  2. the ztunnel emulator starts at the node's ztunnel socket: the agent
//     turns Ready and removes the startup taint;
//  3. an ambient namespace gets a Deployment (HTTP readiness probe; no
//     readiness gate in the manifest: deploy/'s admission policy adds
//     ambient.istio.io/enrolled to the pods the mesh enrolls), a pod that
//     ztunnel refuses and an opted-out pod; a plain namespace gets a pod
//     labelled ambient and a plain client.
//
// It prints who answered connections into and out of each pod (the app, or
// ztunnel after the redirect), the annotation, the AddWorkload ztunnel got,
// the readiness condition, when each pod was enrolled and when kubelet called
// it Ready, where kubelet's probes reached the app from, and the node's taint
// history; then it removes everything. Exit status 0 when every pod ended as
// the policy says and no pod was Ready before it was enrolled.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// nodeReadyCondition is the agent's node condition (docs/readiness.md).
const nodeReadyCondition = corev1.NodeConditionType("ambient.istio.io/NodeReady")

func main() {
	timeout := flag.Duration("timeout", 3*time.Minute, "how long to wait for each step")
	verbose := flag.Bool("v", false, "print the agent's log at the end")
	flag.Parse()
	os.Exit(nodeenv.Program(nodeenv.Options{RegisterTaints: []corev1.Taint{nodeenv.StartupTaint}}, func(ctx context.Context, n *nodeenv.Node) int {
		d := &demo{n: n, out: os.Stdout, step: *timeout, start: time.Now()}
		code := d.run(ctx)
		if *verbose || code != 0 {
			d.agentLog()
		}
		d.cleanup()
		return code
	}))
}

type demo struct {
	n     *nodeenv.Node
	out   io.Writer
	step  time.Duration
	start time.Time
	em    *e2eenv.Emulator
	ok    bool // nothing unexpected so far

	mu       sync.Mutex
	history  []string // node taint / condition changes
	lastNode string
	pods     map[string]*podTimeline // ns/name → what was seen when
	applied  bool
}

// podTimeline is what a pod watch saw, by wall clock.
type podTimeline struct {
	created, enrolled, ready time.Time
	readyBeforeEnrolled      bool
}

// expect is a pod of the demo and where the policy puts it.
type expect struct {
	ns, name string
	inMesh   bool
	refused  bool   // ztunnel refuses it (the emulator nacks its Add)
	why      string // the policy reason, for the table
}

func (d *demo) printf(format string, args ...any) {
	fmt.Fprintf(d.out, "[%6.1fs] "+format+"\n", append([]any{time.Since(d.start).Seconds()}, args...)...)
}

func (d *demo) fail(format string, args ...any) int {
	d.printf("FAIL: "+format, args...)
	return 1
}

func (d *demo) ctx(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(parent, d.step)
}

func (d *demo) run(ctx context.Context) int {
	d.ok = true
	d.pods = map[string]*podTimeline{}
	n := d.n
	node, err := n.Env.CP.Admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	if err != nil {
		return d.fail("node: %v", err)
	}
	d.printf("node %s: kubelet %s, %s, Ready in %s (bring-up of containerd, kubelet, controller-manager, scheduler)",
		n.Name, node.Status.NodeInfo.KubeletVersion, node.Status.NodeInfo.ContainerRuntimeVersion, n.BringUp.Round(time.Millisecond))
	d.printf("node registered with taint %s:%s (kubelet --register-with-taints): ambient pods cannot be scheduled here until the agent can mesh them",
		nodeenv.StartupTaint.Key, nodeenv.StartupTaint.Effect)
	fctx, stop := context.WithCancel(ctx)
	defer stop()
	if err := d.follow(fctx); err != nil {
		return d.fail("informers: %v", err)
	}

	// 1. The DaemonSet, as an operator installs it.
	archive, err := n.AgentImageArchive()
	if err != nil {
		return d.fail("%v", err)
	}
	if err := n.ImportImage(ctx, archive); err != nil {
		return d.fail("import the agent image: %v", err)
	}
	overlay, err := n.WriteAgentOverlay(filepath.Join(n.Dir, "demo-overlay"), nodeenv.AgentTag)
	if err != nil {
		return d.fail("overlay: %v", err)
	}
	d.printf("image %s:%s imported into the node's containerd (%s)", nodeenv.AgentImage, nodeenv.AgentTag, archive)
	d.printf("kubectl apply -k %s   (deploy/ + image tag, imagePullPolicy: Never, KUBERNETES_SERVICE_HOST/PORT = the apiserver: no registry, no kube-proxy here)", overlay)
	applyAt := time.Now()
	out, err := n.Kubectl(ctx, "apply", "-k", overlay)
	if err != nil {
		return d.fail("%v", err)
	}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		// The environment made the agent's namespace, service account and
		// RBAC already (its token identity); kubectl warns it adopts them.
		if !strings.Contains(l, "missing the kubectl.kubernetes.io/last-applied-configuration annotation") {
			fmt.Fprintf(d.out, "           %s\n", l)
		}
	}
	d.mu.Lock()
	d.applied = true
	d.mu.Unlock()
	sctx, cancel := d.ctx(ctx)
	var readyz string
	err = nodeenv.Poll(sctx, "the agent installs its plugin and answers /readyz", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		installed, err := n.PluginInstalled()
		if err != nil || !installed {
			return false, err
		}
		code, body, err := nodeenv.AgentReadyz(ctx)
		readyz = fmt.Sprintf("%d %s", code, firstFailing(body))
		return err == nil && code != 0, err
	})
	cancel()
	if err != nil {
		return d.fail("%v", err)
	}
	name, _, _ := n.RuntimeConfig()
	d.printf("agent pod running: ambientd-cni installed in %s, the CNI config containerd uses (last in the chain: %s); /readyz %s",
		name, chainOf(n), readyz)
	if tainted, _ := n.Tainted(ctx, nodeenv.StartupTaint); tainted {
		d.printf("startup taint still on the node (no ztunnel yet)")
	} else {
		d.ok = false
		d.printf("UNEXPECTED: the startup taint is gone before ztunnel connected")
	}

	// 2. ztunnel.
	emAt := time.Now()
	d.em, err = n.Env.StartEmulator(ctx, e2eenv.EmulatorConfig{Socket: nodeenv.ZtunnelSocket, NetnsMode: true})
	if err != nil {
		return d.fail("ztunnel emulator: %v", err)
	}
	d.printf("ztunnel emulator started at %s", nodeenv.ZtunnelSocket)
	var readyAfter, untaintedAfter time.Duration
	sctx, cancel = d.ctx(ctx)
	err = nodeenv.Poll(sctx, "DaemonSet Ready and startup taint removed", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		ds, err := n.Env.CP.Admin.AppsV1().DaemonSets("istio-system").Get(ctx, "ambientd", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if readyAfter == 0 && ds.Status.NumberReady == 1 {
			readyAfter = time.Since(emAt)
		}
		tainted, err := n.Tainted(ctx, nodeenv.StartupTaint)
		if untaintedAfter == 0 && err == nil && !tainted {
			untaintedAfter = time.Since(emAt)
		}
		return readyAfter != 0 && untaintedAfter != 0, err
	})
	cancel()
	if err != nil {
		return d.fail("%v", err)
	}
	d.printf("DaemonSet ambientd 1/1 Ready %s after ztunnel started (%s after kubectl apply); startup taint removed after %s",
		readyAfter.Round(time.Millisecond), time.Since(applyAt).Round(time.Millisecond), untaintedAfter.Round(time.Millisecond))

	// 3. Workloads.
	pods, code := d.createWorkloads(ctx)
	if code != 0 {
		return code
	}
	return d.report(ctx, pods)
}

// createWorkloads makes the namespaces and pods and waits until each is where
// the policy puts it; it returns the pods' expectations with real names.
func (d *demo) createWorkloads(ctx context.Context) ([]expect, int) {
	n, c := d.n, d.n.Env.CP.Admin
	for name, labels := range map[string]map[string]string{
		"shop":   {podmeta.LabelDataplaneMode: "ambient"},
		"legacy": nil,
	} {
		if _, err := n.Env.CreateNamespace(ctx, name, labels); err != nil {
			return nil, d.fail("namespace %s: %v", name, err)
		}
	}
	d.printf("namespaces: shop (%s=ambient), legacy (no label)", podmeta.LabelDataplaneMode)
	// ztunnel refuses this one: it must stay not Ready.
	if err := d.em.SetNack(ctx, "shop/quarantined", "policy: workload certificate not issued (demo)"); err != nil {
		return nil, d.fail("emulator: %v", err)
	}
	replicas := int32(2)
	labels := map[string]string{"app": "productpage"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "productpage"},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: nodeenv.AppPodSpec()},
		},
	}
	if _, err := c.AppsV1().Deployments("shop").Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		return nil, d.fail("deployment: %v", err)
	}
	d.printf("deployment shop/productpage: 2 replicas, HTTP readiness probe on :%d/healthz, readinessGates: %s (added by the admission policy, not in the manifest)", nodeenv.AppPort, nodeenv.EnrolledCondition)
	plain := func(name string, podLabels map[string]string) *corev1.Pod {
		p := nodeenv.AppPod(name)
		p.Labels = podLabels
		return p
	}
	bare := []struct {
		ns  string
		pod *corev1.Pod
	}{
		{"shop", nodeenv.AppPod("quarantined")},
		{"shop", plain("batch-job", map[string]string{podmeta.LabelDataplaneMode: "none"})},
		{"legacy", func() *corev1.Pod {
			p := nodeenv.AppPod("payments")
			p.Labels = map[string]string{podmeta.LabelDataplaneMode: "ambient"}
			return p
		}()},
		{"legacy", plain("client", nil)},
	}
	for _, b := range bare {
		if _, err := c.CoreV1().Pods(b.ns).Create(ctx, b.pod, metav1.CreateOptions{}); err != nil {
			return nil, d.fail("pod %s/%s: %v", b.ns, b.pod.Name, err)
		}
	}
	d.printf("pods: shop/quarantined (gated; ztunnel will refuse it), shop/batch-job (%s=none), legacy/payments (gated, pod label ambient), legacy/client (plain)", podmeta.LabelDataplaneMode)

	sctx, cancel := d.ctx(ctx)
	defer cancel()
	var deployed []string
	if err := nodeenv.Poll(sctx, "productpage replicas Ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		list, err := c.CoreV1().Pods("shop").List(ctx, metav1.ListOptions{LabelSelector: "app=productpage"})
		if err != nil {
			return false, err
		}
		deployed = deployed[:0]
		for i := range list.Items {
			if nodeenv.PodReady(&list.Items[i]) {
				deployed = append(deployed, list.Items[i].Name)
			}
		}
		return len(deployed) == 2, nil
	}); err != nil {
		return nil, d.fail("%v", err)
	}
	sort.Strings(deployed)
	pods := []expect{
		{ns: "shop", name: deployed[0], inMesh: true, why: "namespace ambient"},
		{ns: "shop", name: deployed[1], inMesh: true, why: "namespace ambient"},
		{ns: "shop", name: "quarantined", inMesh: true, refused: true, why: "namespace ambient; ztunnel refuses"},
		{ns: "shop", name: "batch-job", why: "pod opted out"},
		{ns: "legacy", name: "payments", inMesh: true, why: "pod label ambient"},
		{ns: "legacy", name: "client", why: "not labelled"},
	}
	for _, p := range pods {
		var cond func(*corev1.Pod) bool
		switch {
		case p.refused:
			// Running, refused by ztunnel, condition False, and kubelet has
			// probed it since: still not Ready.
			cond = func(pod *corev1.Pod) bool {
				c := nodeenv.Condition(pod, nodeenv.EnrolledCondition)
				return runningFor(pod, 3*time.Second) && c != nil && c.Status == corev1.ConditionFalse && c.Reason == "ZtunnelRejected"
			}
		case p.inMesh:
			cond = func(pod *corev1.Pod) bool {
				return nodeenv.PodReady(pod) && pod.Annotations[podmeta.AnnotationRedirection] == "enabled"
			}
		default:
			cond = nodeenv.PodReady
		}
		if _, err := n.WaitPod(sctx, p.ns, p.name, cond); err != nil {
			return nil, d.fail("%v", err)
		}
	}
	return pods, 0
}

// runningFor reports whether pod's container has been running for at least
// d (a few of kubelet's 1-second probe periods).
func runningFor(pod *corev1.Pod, d time.Duration) bool {
	if len(pod.Status.ContainerStatuses) == 0 {
		return false
	}
	r := pod.Status.ContainerStatuses[0].State.Running
	return r != nil && time.Since(r.StartedAt.Time) >= d+time.Second // StartedAt has seconds
}

// report prints the tables and decides the exit status.
func (d *demo) report(ctx context.Context, pods []expect) int {
	n, c := d.n, d.n.Env.CP.Admin
	// The pod watch has seen what the API shows (it may lag a poll).
	sctx, cancel := d.ctx(ctx)
	err := nodeenv.Poll(sctx, "the pod watch caught up", 100*time.Millisecond, func(context.Context) (bool, error) {
		for _, p := range pods {
			tl := d.timeline(p.ns + "/" + p.name)
			if !p.refused && (tl.ready.IsZero() || (p.inMesh && tl.enrolled.IsZero())) {
				return false, nil
			}
		}
		return true, nil
	})
	cancel()
	if err != nil {
		return d.fail("%v", err)
	}
	objs := map[string]*corev1.Pod{}
	for _, p := range pods {
		obj, err := c.CoreV1().Pods(p.ns).Get(ctx, p.name, metav1.GetOptions{})
		if err != nil {
			return d.fail("pod %s/%s: %v", p.ns, p.name, err)
		}
		objs[p.name] = obj
	}
	clientIP := netip.MustParseAddr(objs["client"].Status.PodIP)
	clientNetns, err := n.PodNetns(clientIP)
	if err != nil {
		return d.fail("%v", err)
	}
	var st ztunnelemu.State
	if err := d.em.State(ctx, &st); err != nil {
		return d.fail("emulator: %v", err)
	}

	enroll := [][]string{{"POD", "IP", "POLICY", "ANNOTATION", "ADDWORKLOAD (ztunnel)", "INBOUND client→pod:8080", "OUTBOUND pod→client:8080"}}
	ready := [][]string{{"POD", "CONDITION " + string(nodeenv.EnrolledCondition), "ENROLLED", "READY", "KUBELET PROBES REACH THE APP FROM"}}
	gw := n.PodSubnet.Addr().Next().String()
	for _, p := range pods {
		obj := objs[p.name]
		ip := netip.MustParseAddr(obj.Status.PodIP)
		netnsPath, err := n.PodNetns(ip)
		if err != nil {
			return d.fail("%v", err)
		}
		in := who(ctx, clientNetns, netip.AddrPortFrom(ip, nodeenv.AppPort).String())
		outb := "-"
		if p.name != "client" {
			outb = who(ctx, netnsPath, netip.AddrPortFrom(clientIP, nodeenv.AppPort).String())
		}
		ann := obj.Annotations[podmeta.AnnotationRedirection]
		add := addWorkload(st, string(obj.UID))
		cond := "-"
		if cc := nodeenv.Condition(obj, nodeenv.EnrolledCondition); cc != nil {
			cond = fmt.Sprintf("%s %s", cc.Status, cc.Reason)
		}
		probes := d.probeSources(ctx, p.ns, p.name)
		tl := d.timeline(p.ns + "/" + p.name)
		enrolledAt, readyAt := "-", "-"
		if !tl.enrolled.IsZero() {
			enrolledAt = "+" + tl.enrolled.Sub(tl.created).Round(10*time.Millisecond).String()
		}
		if !tl.ready.IsZero() {
			readyAt = "+" + tl.ready.Sub(tl.created).Round(10*time.Millisecond).String()
		}
		readyCol := fmt.Sprintf("%v %s", nodeenv.PodReady(obj), readyAt)
		var bad []string
		// No manifest of the demo names the gate: only the admission
		// policy puts it on the pods the mesh enrolls.
		if gated := slices.ContainsFunc(obj.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool {
			return g.ConditionType == nodeenv.EnrolledCondition
		}); gated != p.inMesh {
			bad = append(bad, fmt.Sprintf("readiness gate from the admission policy: %v", gated))
		}
		switch {
		case p.refused:
			if ann != "pending" || nodeenv.PodReady(obj) || !strings.HasPrefix(in, "refused") {
				bad = append(bad, "a refused pod must stay pending, captured and not Ready")
			}
		case p.inMesh:
			if ann != "enabled" || !strings.HasPrefix(add, "yes") || !strings.HasPrefix(in, "ztunnel :15006") || !strings.HasPrefix(outb, "ztunnel :15001") {
				bad = append(bad, "not enrolled and captured")
			}
			if !strings.HasPrefix(cond, "True") || tl.readyBeforeEnrolled || tl.ready.IsZero() || tl.ready.Before(tl.enrolled) {
				bad = append(bad, "Ready before enrolled")
			}
			if !strings.Contains(probes, nodeenv.ProbeSNATAddr) || strings.Contains(probes, gw) {
				bad = append(bad, "probes not through the SNAT")
			}
		default:
			if ann != "" || add != "-" || !strings.HasPrefix(in, "app") || (outb != "-" && !strings.HasPrefix(outb, "app")) || !nodeenv.PodReady(obj) {
				bad = append(bad, "touched by the mesh")
			}
		}
		why := p.why
		if len(bad) > 0 {
			d.ok = false
			why += "  <-- UNEXPECTED: " + strings.Join(bad, "; ")
		}
		if ann == "" {
			ann = "-"
		}
		name := p.ns + "/" + p.name
		enroll = append(enroll, []string{name, ip.String(), why, ann, add, in, outb})
		ready = append(ready, []string{name, cond, enrolledAt, readyCol, probes})
	}
	fmt.Fprintln(d.out)
	table(d.out, enroll)
	fmt.Fprintln(d.out)
	fmt.Fprintln(d.out, "Readiness (times after the pod was created; READY is kubelet's Ready, which waits for the gate):")
	table(d.out, ready)
	fmt.Fprintf(d.out, "\nkubelet probes: %s is the agent's probe SNAT address (past the capture, never through ztunnel); %s is the bridge gateway (pods out of the mesh).\n", nodeenv.ProbeSNATAddr, gw)
	probedViaZtunnel := 0
	if err := d.em.State(ctx, &st); err == nil {
		for _, a := range st.Accepted {
			if strings.HasPrefix(a.Remote, nodeenv.ProbeSNATAddr+":") || strings.HasPrefix(a.Remote, gw+":") {
				probedViaZtunnel++
			}
		}
	}
	fmt.Fprintf(d.out, "ztunnel emulator: %d workloads, %d requests, %d connections captured, %d of them from kubelet's probe addresses, %d protocol errors\n",
		len(st.Workloads), len(st.Requests), len(st.Accepted), probedViaZtunnel, len(st.ProtocolErrors))
	if probedViaZtunnel > 0 || len(st.ProtocolErrors) > 0 {
		d.ok = false
	}

	// ztunnel accepts the refused pod: it turns Ready only now.
	if err := d.em.ClearNack(ctx, "shop/quarantined"); err != nil {
		return d.fail("emulator: %v", err)
	}
	cleared := time.Now()
	sctx, cancel = d.ctx(ctx)
	err = nodeenv.Poll(sctx, "shop/quarantined enrolled and Ready", 100*time.Millisecond, func(context.Context) (bool, error) {
		tl := d.timeline("shop/quarantined")
		return !tl.enrolled.IsZero() && !tl.ready.IsZero(), nil
	})
	cancel()
	if err != nil {
		d.ok = false
		obj, gerr := c.CoreV1().Pods("shop").Get(ctx, "quarantined", metav1.GetOptions{})
		ann := ""
		if gerr == nil {
			ann = obj.Annotations[podmeta.AnnotationRedirection]
		}
		d.printf("UNEXPECTED: shop/quarantined not Ready after ztunnel accepted it: %v; now: annotation %q, %s (%v)", err, ann, nodeenv.Describe(obj), gerr)
	} else {
		tl := d.timeline("shop/quarantined")
		d.printf("ztunnel now accepts shop/quarantined: enrolled %s and Ready %s later (the agent retries the Add; kubelet's gate follows)",
			tl.enrolled.Sub(cleared).Round(10*time.Millisecond), tl.ready.Sub(cleared).Round(10*time.Millisecond))
	}

	fmt.Fprintln(d.out, "\nNode taints and the agent's node condition over time (times after the demo started):")
	d.mu.Lock()
	for _, h := range d.history {
		fmt.Fprintf(d.out, "  %s\n", h)
	}
	d.mu.Unlock()

	if d.ok {
		fmt.Fprintln(d.out, "\nRESULT: every pod is enrolled exactly as the policy says, and no pod was Ready before it was enrolled.")
		return 0
	}
	fmt.Fprintln(d.out, "\nRESULT: FAIL: something is not where the policy puts it (marked above).")
	return 1
}

// follow keeps the node's taint/condition history and the pods' timelines
// from informers (which, unlike a bare watch, list and watch again when the
// apiserver ends a watch) until ctx ends.
func (d *demo) follow(ctx context.Context) error {
	f := informers.NewSharedInformerFactory(d.n.Env.CP.Admin, 0)
	for inf, observe := range map[cache.SharedIndexInformer]func(any){
		f.Core().V1().Nodes().Informer(): d.observeNode,
		f.Core().V1().Pods().Informer():  d.observePod,
	} {
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    observe,
			UpdateFunc: func(_, obj any) { observe(obj) },
		}); err != nil {
			return err
		}
	}
	f.Start(ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("informer for %v did not sync", typ)
		}
	}
	go func() { <-ctx.Done(); f.Shutdown() }()
	return nil
}

// observeNode records the node's taints and the agent's node condition
// each time they change.
func (d *demo) observeNode(obj any) {
	node, ok := obj.(*corev1.Node)
	if !ok || node.Name != d.n.Name {
		return
	}
	var taints []string
	for _, t := range node.Spec.Taints {
		taints = append(taints, t.Key+":"+string(t.Effect))
	}
	cond := "none"
	for _, c := range node.Status.Conditions {
		if c.Type == nodeReadyCondition {
			cond = fmt.Sprintf("%s (%s)", c.Status, c.Reason)
		}
	}
	s := fmt.Sprintf("taints [%s]; %s %s", strings.Join(taints, ", "), nodeReadyCondition, cond)
	d.mu.Lock()
	defer d.mu.Unlock()
	if s == d.lastNode {
		return
	}
	d.lastNode = s
	label := "before kubectl apply"
	if d.applied {
		label = "after kubectl apply"
	}
	d.history = append(d.history, fmt.Sprintf("%6.1fs  %-20s %s", time.Since(d.start).Seconds(), label, s))
}

// observePod records, per pod of the demo's namespaces, when it was created,
// enrolled (annotation enabled and condition True) and Ready, and whether it
// was ever seen Ready while not enrolled.
func (d *demo) observePod(obj any) {
	p, ok := obj.(*corev1.Pod)
	if !ok || (p.Namespace != "shop" && p.Namespace != "legacy") {
		return
	}
	now := time.Now()
	c := nodeenv.Condition(p, nodeenv.EnrolledCondition)
	enrolled := p.Annotations[podmeta.AnnotationRedirection] == "enabled" && c != nil && c.Status == corev1.ConditionTrue
	ready := nodeenv.PodReady(p)
	d.mu.Lock()
	defer d.mu.Unlock()
	tl := d.pods[p.Namespace+"/"+p.Name]
	if tl == nil {
		// The informers run before the demo creates pods: first sight is
		// creation, to the millisecond (the API's timestamp has seconds).
		tl = &podTimeline{created: now}
		d.pods[p.Namespace+"/"+p.Name] = tl
	}
	if enrolled && tl.enrolled.IsZero() {
		tl.enrolled = now
	}
	if ready && tl.ready.IsZero() {
		tl.ready = now
	}
	if ready && !enrolled && len(p.Spec.ReadinessGates) > 0 {
		tl.readyBeforeEnrolled = true
	}
}

func (d *demo) timeline(key string) podTimeline {
	d.mu.Lock()
	defer d.mu.Unlock()
	if tl := d.pods[key]; tl != nil {
		return *tl
	}
	return podTimeline{}
}

// probeSources summarizes where kubelet's readiness probes reached the app
// from (its log names each probe's client address).
func (d *demo) probeSources(ctx context.Context, ns, name string) string {
	logs, err := d.n.Kubectl(ctx, "logs", "-n", ns, name)
	if err != nil {
		return "log: " + oneLine(err.Error())
	}
	count := map[string]int{}
	for _, l := range strings.Split(logs, "\n") {
		_, after, ok := strings.Cut(l, "probe /healthz from ")
		if !ok {
			continue
		}
		if host, _, ok := strings.Cut(after, ":"); ok {
			count[host]++
		}
	}
	if len(count) == 0 {
		return "none reached the app"
	}
	var parts []string
	for host, k := range count {
		parts = append(parts, fmt.Sprintf("%s (%d)", host, k))
	}
	slices.Sort(parts)
	return strings.Join(parts, ", ")
}

// who connects from the netns at netnsPath to dst, sends an HTTP request and
// says who answered: the app itself, or ztunnel (the emulator writes a line
// naming its listener as soon as it accepts).
func who(ctx context.Context, netnsPath, dst string) string {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := nodeenv.DialFrom(dctx, netnsPath, dst)
	if err != nil {
		if strings.Contains(err.Error(), "connection refused") {
			return "refused (captured; ztunnel does not serve the pod)"
		}
		return "error: " + oneLine(err.Error())
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: demo\r\n\r\n")
	line, _ := bufio.NewReader(io.LimitReader(c, 4096)).ReadString('\n')
	line = strings.TrimSpace(line)
	switch {
	case strings.HasPrefix(line, "HTTP/"):
		return "app (direct)"
	case strings.HasPrefix(line, "ztunnel-emulator"):
		kv := map[string]string{}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok {
				kv[k] = v
			}
		}
		return fmt.Sprintf("ztunnel :%s (orig dst %s)", kv["listener"], kv["orig_dst"])
	case line == "":
		return "no answer"
	}
	return "? " + oneLine(line)
}

func addWorkload(st ztunnelemu.State, uid string) string {
	last := "-"
	for _, r := range st.Requests {
		if r.Op != "add" || r.UID != uid {
			continue
		}
		if r.AckError != "" {
			last = "refused: " + oneLine(r.AckError)
			continue
		}
		return fmt.Sprintf("yes, netns inode %d", r.NetnsInode)
	}
	return last
}

// chainOf lists the plugin types of the CNI config containerd uses, in
// order.
func chainOf(n *nodeenv.Node) string {
	_, s, err := n.RuntimeConfig()
	if err != nil {
		return "?"
	}
	var conf struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(s), &conf); err != nil {
		return "? (" + oneLine(err.Error()) + ")"
	}
	var types []string
	for _, p := range conf.Plugins {
		types = append(types, p.Type)
	}
	return strings.Join(types, " → ")
}

// firstFailing is the first failing check of a verbose /readyz body.
func firstFailing(body string) string {
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, "[-]") {
			return strings.TrimSpace(l)
		}
	}
	return oneLine(body)
}

func table(w io.Writer, rows [][]string) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	tw.Flush()
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 120 {
		s = s[:120] + "..."
	}
	return s
}

// agentLog prints the tail of the agent's log.
func (d *demo) agentLog() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	logs, err := d.n.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/ambientd", "--tail=80")
	fmt.Fprintf(d.out, "\n----- agent log (last 80 lines; %v) -----\n%s\n", err, logs)
}

// cleanup deletes the demo's namespaces (kubelet tears the pods down through
// the CNI chain while the agent still runs), then the DaemonSet (the agent
// removes its plugin from the conflist), then stops the emulator.
func (d *demo) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := d.n.Env.CP.Admin
	for _, ns := range []string{"shop", "legacy"} {
		if err := c.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			d.printf("cleanup: namespace %s: %v", ns, err)
		}
	}
	start := time.Now()
	err := nodeenv.Poll(ctx, "demo pods gone", 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		left := 0
		for _, ns := range []string{"shop", "legacy"} {
			list, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			left += len(list.Items)
		}
		return left == 0, nil
	})
	if err != nil {
		d.printf("cleanup: %v", err)
	}
	if err := c.AppsV1().DaemonSets("istio-system").Delete(ctx, "ambientd", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		d.printf("cleanup: DaemonSet: %v", err)
	}
	err = nodeenv.Poll(ctx, "agent gone and its plugin uninstalled", 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := d.n.AgentPod(ctx)
		if err != nil || p != nil {
			return false, err
		}
		installed, err := d.n.PluginInstalled()
		return !installed, err
	})
	if err != nil {
		d.printf("cleanup: %v", err)
	} else {
		d.printf("cleanup: pods deleted through the CNI chain, DaemonSet deleted, ambientd-cni removed from the CNI config (%s)", time.Since(start).Round(100*time.Millisecond))
	}
	if d.em != nil {
		_ = d.em.Stop(5 * time.Second)
	}
}
