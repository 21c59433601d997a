//go:build e2enode

package e2enode

import (
	"context"
	"io"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// The node registered itself through kubelet (with the taint it was told to
// register with), is Ready, lost the not-ready taint (kube-controller-manager
// runs), and reports the real runtime.
func TestNodeRegistersReady(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, time.Minute)
	n, err := node.Env.CP.Admin.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.NodeReady(n); err != nil {
		t.Fatalf("node %s: %v", node.Name, err)
	}
	if got := n.Status.NodeInfo.ContainerRuntimeVersion; !strings.HasPrefix(got, "containerd://") {
		t.Errorf("container runtime %q, want containerd://...", got)
	}
	registered := false
	for _, tt := range n.Spec.Taints {
		registered = registered || (tt.Key == registerTaint.Key && tt.Value == registerTaint.Value && tt.Effect == registerTaint.Effect)
	}
	if !registered {
		t.Errorf("node taints %+v lack the registration taint %+v", n.Spec.Taints, registerTaint)
	}
	var internal string
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			internal = a.Address
		}
	}
	if internal != node.IP.String() {
		t.Errorf("InternalIP %q, want %s", internal, node.IP)
	}
	t.Logf("node %s: kubelet %s, %s, kernel %s; bring-up %s",
		n.Name, n.Status.NodeInfo.KubeletVersion, n.Status.NodeInfo.ContainerRuntimeVersion, n.Status.NodeInfo.KernelVersion, node.BringUp.Round(time.Millisecond))
}

// A pod with an HTTP readiness probe gets an address from containerd's CNI
// call (bridge + host-local in the node's conf dir), kubelet's probes reach
// it from the node, it turns Ready and serves; deleting it leaves nothing
// behind (netns, veth, lease, running tasks, shims, pod cgroup).
func TestPodReadyThroughCNIAndDeletedClean(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 3*time.Minute)
	ns := namespace(t, ctx, "smoke-pod")
	before, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	_, err = node.Env.CP.Admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "app"},
		Spec:       appPodSpec(),
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod, err := waitPod(ctx, ns, "app", podReady)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod create -> Ready: %s", time.Since(start).Round(time.Millisecond))

	ip, err := netip.ParseAddr(pod.Status.PodIP)
	if err != nil || !node.PodSubnet.Contains(ip) {
		t.Fatalf("pod IP %q not in the node's pod subnet %s", pod.Status.PodIP, node.PodSubnet)
	}
	if pod.Spec.NodeName != node.Name {
		t.Errorf("scheduled to %q, want %s", pod.Spec.NodeName, node.Name)
	}
	during, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(during.Netns) != len(before.Netns)+1 || len(during.Leases) != len(before.Leases)+1 || len(during.Veths) != len(before.Veths)+1 {
		t.Errorf("running pod: want one more netns, lease and bridge port than before\nbefore: %s\nnow:    %s", before, during)
	}
	if !slices.Contains(during.Leases, ip.String()) {
		t.Errorf("host-local leases %v do not hold the pod IP %s", during.Leases, ip)
	}

	// The app answers from the node, and kubelet's probes came from the
	// bridge gateway (the node's side of the pod network).
	body := httpGet(t, ctx, "http://"+netip.AddrPortFrom(ip, nodeenv.AppPort).String()+"/")
	if want := "hello from app"; strings.TrimSpace(body) != want {
		t.Errorf("GET / = %q, want %q", body, want)
	}
	// `kubectl logs` goes apiserver -> kubelet (the node's hostname) ->
	// containerd's log file.
	gw := node.PodSubnet.Addr().Next().String()
	logs, err := node.Kubectl(ctx, "logs", "-n", ns, "app")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs, "probe /healthz from "+gw+":") {
		t.Errorf("container log shows no probe from the gateway %s:\n%s", gw, logs)
	}

	if err := node.Env.CP.Admin.CoreV1().Pods(ns).Delete(ctx, "app", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, "app", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatalf("pod never went away: %v", err)
	}
	// When each kind of thing was back to its state before the pod.
	var after nodeenv.State
	clean := map[string]time.Duration{}
	kinds := []string{"netns", "bridge ports", "leases", "tasks", "shims", "pod cgroups"}
	if err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		after, err = node.State(ctx)
		if err != nil {
			return false, nil
		}
		diff := after.Diff(before)
		for _, k := range kinds {
			if _, seen := clean[k]; !seen && !slices.Contains(diff, k) {
				clean[k] = time.Since(start).Round(time.Millisecond)
			}
		}
		return len(diff) == 0, nil
	}); err != nil {
		t.Fatalf("deleted pod left things behind (%v): %v\nbefore: %s\nafter:  %s", err, after.Diff(before), before, after)
	}
	t.Logf("pod gone from the API -> node clean: %s (%v)", time.Since(start).Round(time.Millisecond), clean)
}

// A DaemonSet's pod is created by the DaemonSet controller
// (kube-controller-manager), bound by kube-scheduler, started by kubelet, and
// turns Ready; the DaemonSet reports it. Its pod sees the node the way
// ambientd's DaemonSet (deploy/) mounts it: the node's conflist in the
// hostPath /etc/cni/net.d, and, through /var/run/netns with HostToContainer
// propagation, the netns of a pod started after it.
func TestDaemonSetPodScheduledAndReady(t *testing.T) {
	logsOnFailure(t)
	ctx := testutil.Context(t, 3*time.Minute)
	ns := namespace(t, ctx, "smoke-ds")
	labels := map[string]string{"app": "smoke-ds"}
	spec := appPodSpec()
	toContainer := corev1.MountPropagationHostToContainer
	spec.Containers[0].VolumeMounts = []corev1.VolumeMount{
		{Name: "cni-conf", MountPath: "/host/etc/cni/net.d", ReadOnly: true},
		{Name: "netns", MountPath: "/host/run/netns", MountPropagation: &toContainer},
	}
	spec.Volumes = []corev1.Volume{
		{Name: "cni-conf", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/etc/cni/net.d"}}},
		{Name: "netns", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/var/run/netns"}}},
	}
	start := time.Now()
	_, err := node.Env.CP.Admin.AppsV1().DaemonSets(ns).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "smoke"},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       spec,
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var ds *appsv1.DaemonSet
	if err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		ds, err = node.Env.CP.Admin.AppsV1().DaemonSets(ns).Get(ctx, "smoke", metav1.GetOptions{})
		return err == nil && ds.Status.DesiredNumberScheduled == 1 && ds.Status.NumberReady == 1, nil
	}); err != nil {
		pods, _ := node.Env.CP.Admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
		var desc []string
		for i := range pods.Items {
			desc = append(desc, pods.Items[i].Name+": "+describe(&pods.Items[i]))
		}
		t.Fatalf("DaemonSet never Ready: %v; status %+v; pods: %v", err, ds.Status, desc)
	}
	t.Logf("DaemonSet create -> 1/1 Ready: %s", time.Since(start).Round(time.Millisecond))
	pods, err := node.Env.CP.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("DaemonSet pods: %v %v", pods, err)
	}
	p := pods.Items[0]
	if p.Spec.NodeName != node.Name || !podReady(&p) || p.Spec.HostNetwork {
		t.Errorf("DaemonSet pod %s: %s (want on %s, Ready, pod network)", p.Name, describe(&p), node.Name)
	}

	ls := func(dir string) string {
		return httpGet(t, ctx, "http://"+netip.AddrPortFrom(netip.MustParseAddr(p.Status.PodIP), nodeenv.AppPort).String()+"/ls?dir="+dir)
	}
	if got := ls("/host/etc/cni/net.d"); !strings.Contains(got, "10-ambientd-node.conflist") {
		t.Errorf("DaemonSet pod's /etc/cni/net.d lists %q, want the node's conflist", got)
	}
	_, later := startPod(t, ctx, ns, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "later"}, Spec: appPodSpec()})
	if got := ls("/host/run/netns"); !strings.Contains(got, filepath.Base(later)) {
		t.Errorf("DaemonSet pod's /var/run/netns lists %q, want the later pod's %s (HostToContainer propagation)", got, filepath.Base(later))
	}
}

func httpGet(t *testing.T, ctx context.Context, url string) string {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return string(b)
}

// appPodSpec runs the app image (pod network, HTTP readiness probe) and
// stops within 5 seconds. It tolerates the agent's startup taint, so the
// smoke tests run whether or not an agent removed it.
func appPodSpec() corev1.PodSpec {
	grace := int64(5)
	return corev1.PodSpec{
		Containers:                    []corev1.Container{nodeenv.AppContainer()},
		TerminationGracePeriodSeconds: &grace,
		Tolerations:                   []corev1.Toleration{{Key: startupTaint.Key, Operator: corev1.TolerationOpExists, Effect: startupTaint.Effect}},
	}
}
