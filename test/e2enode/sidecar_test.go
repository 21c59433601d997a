//go:build e2enode

package e2enode

import (
	"bufio"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// Sidecar mode on the real node: pods exactly as Istio's injector injects
// them in CNI mode (the oracle's golden injected pods, test/istio-oracle),
// with the images swapped for local ones: the app image, a stand-in
// istio-proxy (listeners on 15001/15006 that answer with where a connection
// landed, health on 15021) and our istio-validation as the validation
// image (test/infra/validation; make istio-oracle-check proves it judges as
// Istio's does).

// sidecarManifest is the golden case's pod (injected, or the input pod
// before injection) named name, images swapped, volumes dropped (the
// injector's projected token and CA configmap are Istio's), and kubelet's
// view of a quick test pod (grace 2 s, tolerating the startup taint).
func sidecarManifest(t *testing.T, golden, name string, injected bool) *corev1.Pod {
	t.Helper()
	c, err := istiogolden.LoadCase(golden)
	if err != nil {
		t.Fatal(err)
	}
	src := c.Input
	if injected {
		src = c.Injected
	}
	if src == nil {
		t.Fatalf("%s: no pod", golden)
	}
	p := src.DeepCopy()
	p.Name, p.Namespace, p.Status = name, "", corev1.PodStatus{}
	grace := int64(2)
	p.Spec.TerminationGracePeriodSeconds = &grace
	p.Spec.Volumes = nil
	p.Spec.Tolerations = append(p.Spec.Tolerations, corev1.Toleration{Key: startupTaint.Key, Operator: corev1.TolerationOpExists, Effect: startupTaint.Effect})
	for _, cs := range [][]corev1.Container{p.Spec.InitContainers, p.Spec.Containers} {
		for i := range cs {
			ct := &cs[i]
			ct.VolumeMounts, ct.Lifecycle, ct.Resources = nil, nil, corev1.ResourceRequirements{}
			ct.ImagePullPolicy = corev1.PullNever
			switch ct.Name {
			case "istio-validation":
				ct.Image = nodeenv.ValidationImage
			case "istio-proxy", "istio-init":
				ct.Image = nodeenv.ProxyImage
			default:
				ct.Image = nodeenv.AppImage
			}
		}
	}
	return p
}

// readLine dials dst from the namespace at netnsPath and returns the first
// line answered (the stand-in proxy says where the connection landed).
func readLine(t *testing.T, ctx context.Context, netnsPath, dst string) string {
	t.Helper()
	c, err := nodeenv.DialFrom(ctx, netnsPath, dst)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the answer to %s from %s: %v", dst, netnsPath, err)
	}
	return strings.TrimSpace(line)
}

// validationStatus is the istio-validation init container's status.
func validationStatus(p *corev1.Pod) (corev1.ContainerStatus, bool) {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == "istio-validation" {
			return s, true
		}
	}
	return corev1.ContainerStatus{}, false
}

// exited reports whether the container's current or last run ended with
// code.
func exited(s corev1.ContainerStatus, code int32) bool {
	return s.State.Terminated != nil && s.State.Terminated.ExitCode == code ||
		s.LastTerminationState.Terminated != nil && s.LastTerminationState.Terminated.ExitCode == code
}

// sidecarRules lists, in the namespace at netnsPath, the sidecar rules of
// every backend: nft's istio-proxy-* tables and iptables' ISTIO_INBOUND,
// ISTIO_REDIRECT and ISTIO_IN_REDIRECT chains ("" when there are none).
func sidecarRules(t *testing.T, ctx context.Context, netnsPath string) string {
	t.Helper()
	var out []string
	for _, args := range [][]string{{"nft", "list", "ruleset"}, {"iptables-legacy-save"}, {"iptables-nft-save"}} {
		b, err := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + netnsPath}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s in %s: %v: %s", strings.Join(args, " "), netnsPath, err, b)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, "istio-proxy-") || strings.Contains(l, "ISTIO_INBOUND") || strings.Contains(l, "ISTIO_REDIRECT") {
				out = append(out, args[0]+": "+strings.TrimSpace(l))
			}
		}
	}
	return strings.Join(out, "\n")
}

// podEvent waits for an Event with reason on pod ns/name and returns it.
func podEvent(t *testing.T, ctx context.Context, ns, name, reason string) corev1.Event {
	t.Helper()
	var found corev1.Event
	if err := nodeenv.Poll(ctx, "Event "+reason+" on "+ns+"/"+name, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		evs, err := node.Env.CP.Admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name + ",reason=" + reason})
		if err != nil || len(evs.Items) == 0 {
			return false, err
		}
		found = evs.Items[0]
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	return found
}

// capturedForProxy proves a sidecar pod's capture with connections: its
// outbound TCP (as the app, uid 0) lands on the stand-in proxy's 15001 with
// the original destination, inbound from another pod to the app port on
// 15006; and nothing of it went to ztunnel or got the ambient annotation.
func (r *agentRun) capturedForProxy(t *testing.T, ctx context.Context, p *corev1.Pod, client string) string {
	t.Helper()
	podIP := netip.MustParseAddr(p.Status.PodIP)
	netnsPath, err := node.PodNetns(podIP)
	if err != nil {
		t.Fatal(err)
	}
	outDst := netip.AddrPortFrom(node.IP, 9).String()
	if got, want := readLine(t, ctx, netnsPath, outDst), "istio-proxy 15001 "+outDst; got != want {
		t.Errorf("outbound from the sidecar pod: %q, want %q", got, want)
	}
	inDst := netip.AddrPortFrom(podIP, nodeenv.AppPort).String()
	if got, want := readLine(t, ctx, client, inDst), "istio-proxy 15006 "+inDst; got != want {
		t.Errorf("inbound to the sidecar pod's app port: %q, want %q", got, want)
	}
	if v, ok := p.Annotations[podmeta.AnnotationRedirection]; ok {
		t.Errorf("sidecar pod annotated %s=%s", podmeta.AnnotationRedirection, v)
	}
	var st ztunnelemu.State
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(st.Requests, func(q ztunnelemu.RequestRecord) bool { return q.UID == string(p.UID) }) {
		t.Errorf("sidecar pod sent to ztunnel: %v", opsFor(st, string(p.UID)))
	}
	return netnsPath
}

// sidecarClient starts a pod outside any mesh in its own namespace (named
// after the step: steps' namespaces are deleted asynchronously) and returns
// its netns path.
func sidecarClient(t *testing.T, ctx context.Context, step string) string {
	t.Helper()
	ns := namespace(t, ctx, "client-"+step)
	_, netns := startPod(t, ctx, ns, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "client"}, Spec: appPodSpec()})
	return netns
}

// sidecarPodCapturedValidated: a pod injected by Istio's injector in CNI
// mode (native istio-proxy sidecar, istio-validation init container) starts
// on the node: its istio-validation passes on its first run (the rules were
// in place before any container started), the app starts, the pod turns
// Ready, outbound lands on 15001 and inbound on 15006; never ztunnel's.
func (r *agentRun) sidecarPodCapturedValidated(t *testing.T, ctx context.Context) {
	ns := namespace(t, ctx, "sidecar-app")
	start := time.Now()
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, sidecarManifest(t, "redirect-default", "web", true), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := waitPod(ctx, ns, "web", podReady)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("injected sidecar pod create -> Ready: %s", time.Since(start).Round(time.Millisecond))
	s, ok := validationStatus(p)
	if !ok || s.State.Terminated == nil || s.State.Terminated.ExitCode != 0 || s.RestartCount != 0 {
		t.Errorf("istio-validation: %+v, want passed on its first run", s)
	}
	r.capturedForProxy(t, ctx, p, sidecarClient(t, ctx, "captured"))
}

// sidecarSkipCases: Istio's skip cases each start with success and no
// sidecar rules: istio-init present (the pod redirects itself), no
// istio-proxy, a gateway (proxy router), sidecar.istio.io/inject=false
// (annotation and label), no sidecar.istio.io/status, DISABLE_ENVOY, and a
// hostNetwork pod (no CNI at all). Those with an istio-validation container
// prove it too: it fails with 126 (and the repair controller leaves them:
// the skip order says they are not to be captured).
func (r *agentRun) sidecarSkipCases(t *testing.T, ctx context.Context) {
	ns := namespace(t, ctx, "sidecar-skip")
	cases := []string{"skip-istio-init", "skip-no-istio-proxy", "skip-gateway", "skip-inject-annotation-false",
		"skip-inject-label-false", "skip-no-status", "skip-disable-envoy", "skip-host-network"}
	for i, name := range cases {
		m := sidecarManifest(t, name, fmt.Sprintf("skip%d", i), true)
		if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, m, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for i, name := range cases {
		pod := fmt.Sprintf("skip%d", i)
		p, err := waitPod(ctx, ns, pod, func(p *corev1.Pod) bool {
			if s, ok := validationStatus(p); ok {
				return p.Status.PodIP != "" && exited(s, 126)
			}
			return podReady(p)
		})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if p.Spec.HostNetwork {
			if rules := sidecarRules(t, ctx, "/proc/self/ns/net"); rules != "" {
				t.Errorf("%s: sidecar rules in the node's namespace:\n%s", name, rules)
			}
			continue
		}
		netnsPath, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
		if err != nil {
			t.Fatal(err)
		}
		if rules := sidecarRules(t, ctx, netnsPath); rules != "" {
			t.Errorf("%s: sidecar rules programmed:\n%s", name, rules)
		}
		if v, ok := p.Annotations[podmeta.AnnotationRedirection]; ok {
			t.Errorf("%s: annotated %s", name, v)
		}
		t.Logf("%s: %s", name, describe(p))
	}
}

// sidecarPodWithoutPluginRepaired: the same injected pod started without
// our plugin (in an excluded namespace the plugin passes through: the
// runtime starts it with no capture) — its istio-validation exits 126, and
// the repair controller programs its rules (Event RepairBrokenPod, source
// cni-repair): the next validation run passes, the app starts, the pod is
// captured.
func (r *agentRun) sidecarPodWithoutPluginRepaired(t *testing.T, ctx context.Context) {
	const ns = "kube-system" // excluded: the plugin passes the pod through
	name := fmt.Sprintf("broken-%d", time.Now().Unix()%100000)
	start := time.Now()
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, sidecarManifest(t, "redirect-default", name, true), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = node.Env.CP.Admin.CoreV1().Pods(ns).Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	p, err := waitPod(ctx, ns, name, func(p *corev1.Pod) bool {
		s, _ := validationStatus(p)
		return exited(s, 126)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("without the plugin: istio-validation exited 126 after %s", time.Since(start).Round(time.Millisecond))
	ev := podEvent(t, ctx, ns, name, "RepairBrokenPod")
	if ev.Source.Component != "cni-repair" || ev.Type != corev1.EventTypeWarning {
		t.Errorf("Event %+v: want a Warning from cni-repair", ev)
	}
	if p, err = waitPod(ctx, ns, name, podReady); err != nil {
		t.Fatal(err)
	}
	t.Logf("repaired: Ready %s after creation; %s", time.Since(start).Round(time.Millisecond), describe(p))
	s, _ := validationStatus(p)
	if s.State.Terminated == nil || s.State.Terminated.ExitCode != 0 || s.RestartCount == 0 {
		t.Errorf("istio-validation %+v: want passed after at least one failed run", s)
	}
	r.capturedForProxy(t, ctx, p, sidecarClient(t, ctx, "repaired"))
}

// sidecarNamespaceMigratesToAmbient: a namespace of sidecar pods relabelled
// ambient keeps its running sidecar pods on their proxy (never ztunnel);
// its pods recreated without injection (what the injector does once the
// namespace is no longer injected) are captured by the ambient path, and
// the old sidecar pod's rules are gone with its sandbox.
func (r *agentRun) sidecarNamespaceMigratesToAmbient(t *testing.T, ctx context.Context) {
	ns := namespace(t, ctx, "sidecar-migrate")
	if _, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, sidecarManifest(t, "redirect-default", "web", true), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := waitPod(ctx, ns, "web", podReady)
	if err != nil {
		t.Fatal(err)
	}
	client := sidecarClient(t, ctx, "migrate")
	oldNetns := r.capturedForProxy(t, ctx, p, client)
	// A plain pod beside it: the agent syncs a relabelled namespace's pods
	// together, so once it has enrolled this one it has handled the
	// relabel, and what the sidecar pod shows then is the agent's decision
	// about it, not a sync still to come.
	witness, _ := startPod(t, ctx, ns, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "witness"}, Spec: appPodSpec()})

	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"ambient"}}}`, podmeta.LabelDataplaneMode)
	if _, err := node.Env.CP.Admin.CoreV1().Namespaces().Patch(ctx, ns, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := waitPod(ctx, ns, "witness", func(p *corev1.Pod) bool {
		return p.Annotations[podmeta.AnnotationRedirection] == podmeta.RedirectionEnabled
	}); err != nil {
		t.Fatalf("the plain pod of the relabelled namespace: %v", err)
	}
	r.waitEmu(t, ctx, "the plain pod of the relabelled namespace held by ztunnel", func(s ztunnelemu.State) bool {
		_, ok := s.Workload(string(witness.UID))
		return ok
	})
	// The running sidecar pod is left as it is: relabelling moves no
	// running sidecar pod to ztunnel.
	if p, err = node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	r.capturedForProxy(t, ctx, p, client)

	if err := node.Env.CP.Admin.CoreV1().Pods(ns).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "the sidecar pod and its sandbox gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
		_, serr := os.Stat(oldNetns)
		return apierrors.IsNotFound(err) && os.IsNotExist(serr), nil
	}); err != nil {
		t.Fatal(err)
	}
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, sidecarManifest(t, "redirect-default", "web", false), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := string(created.UID)
	if p, err = waitPod(ctx, ns, "web", func(p *corev1.Pod) bool {
		return podReady(p) && p.Annotations[podmeta.AnnotationRedirection] == "enabled"
	}); err != nil {
		t.Fatal(err)
	}
	st := r.waitEmu(t, ctx, "the recreated pod held by ztunnel", func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	w, _ := st.Workload(uid)
	netnsPath := netnsByInode(t, w.NetnsInode)
	if rules := sidecarRules(t, ctx, netnsPath); rules != "" {
		t.Errorf("the recreated (ambient) pod has sidecar rules:\n%s", rules)
	}
	dialFrom(t, ctx, netnsPath, netip.AddrPortFrom(node.IP, 9).String())
	r.waitEmu(t, ctx, "the recreated pod's outbound on ztunnel's 15001", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
	})
	if _, err := os.Stat(oldNetns); !os.IsNotExist(err) {
		t.Errorf("the old sidecar pod's namespace %s still exists: %v", oldNetns, err)
	}
}

// sidecarBrokenPodDeleted: with the repair-delete component (its RBAC and
// the admission policy's allowance; AMBIENTD_REPAIR_MODE=delete), a pod
// started without our plugin whose istio-validation exits 126 is deleted by
// the agent, with Istio's Event DeleteBrokenPod. Then the default (repair)
// is restored and the component's role removed.
func (r *agentRun) sidecarBrokenPodDeleted(t *testing.T, ctx context.Context) {
	old, err := node.AgentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("agent pod: %v", err)
	}
	const tag = "dev-repair-delete"
	tagImage(t, ctx, tag)
	dir := t.TempDir()
	base, err := filepath.Rel(dir, overlay(t, tag))
	if err != nil {
		t.Fatal(err)
	}
	comp, err := filepath.Rel(dir, filepath.Join(node.Env.Root, "deploy", "components", "repair-delete"))
	if err != nil {
		t.Fatal(err)
	}
	k := fmt.Sprintf("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [%s]\ncomponents: [%s]\n", base, comp)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.restoreRepairMode(t) })
	if out, err := node.Kubectl(ctx, "apply", "-k", dir); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	waitNewAgent(t, ctx, old.UID)

	const ns = "kube-system"
	name := fmt.Sprintf("broken-del-%d", time.Now().Unix()%100000)
	created, err := node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, sidecarManifest(t, "redirect-default", name, true), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ev := podEvent(t, ctx, ns, name, "DeleteBrokenPod")
	if ev.Message != "pod detected as broken, deleted" || ev.Source.Component != "cni-repair" || ev.InvolvedObject.UID != created.UID {
		t.Errorf("Event %+v: want Istio's DeleteBrokenPod from cni-repair about the pod", ev)
	}
	if err := nodeenv.Poll(ctx, "the broken pod deleted", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatal(err)
	}
}

// tagImage tags the agent's image as tag in the node's containerd (a new
// tag makes `kubectl apply` roll the DaemonSet).
func tagImage(t *testing.T, ctx context.Context, tag string) {
	t.Helper()
	out, err := exec.CommandContext(ctx, node.Bins.Ctr, "--address", node.ContainerdAddress, "--namespace", "k8s.io",
		"images", "tag", "--force", nodeenv.AgentImage+":"+nodeenv.AgentTag, nodeenv.AgentImage+":"+tag).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images tag: %v: %s", err, out)
	}
}

// waitNewAgent waits for an agent pod other than old to be Ready.
func waitNewAgent(t *testing.T, ctx context.Context, old types.UID) {
	t.Helper()
	if err := nodeenv.Poll(ctx, "the DaemonSet rolled to a new Ready agent", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return err == nil && p != nil && p.UID != old && podReady(p), err
	}); err != nil {
		t.Fatal(err)
	}
}

// restoreRepairMode puts the agent back to deploy/'s default (repair mode)
// and removes the repair-delete component's role and binding.
func (r *agentRun) restoreRepairMode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	old, _ := node.AgentPod(ctx)
	const tag = "dev-repair-restored"
	tagImage(t, ctx, tag)
	if out, err := node.Kubectl(ctx, "apply", "-k", overlay(t, tag)); err != nil {
		t.Errorf("restoring the overlay: %v: %s", err, out)
	}
	for _, kind := range []string{"clusterrolebinding", "clusterrole"} {
		if out, err := node.Kubectl(ctx, "delete", "--ignore-not-found", kind, "ambientd-repair-delete"); err != nil {
			t.Errorf("delete %s: %v: %s", kind, err, out)
		}
	}
	if old != nil {
		waitNewAgent(t, ctx, old.UID)
	}
}
