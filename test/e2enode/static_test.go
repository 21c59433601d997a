//go:build e2enode

package e2enode

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// startStaticPod puts a static pod named name in namespace ns in the
// kubelet's static pod directory (removed when the test ends) and waits
// until its mirror pod is Ready; it returns the mirror pod and how long
// manifest → Ready took.
func startStaticPod(t *testing.T, ctx context.Context, ns, name string) (*corev1.Pod, time.Duration) {
	t.Helper()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: nodeenv.AppPodSpec()}
	start := time.Now()
	if err := node.WriteStaticPod(pod); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeStaticPod(t, context.Background(), ns, name) })
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	p, err := waitPod(wctx, ns, node.MirrorPodName(name), podReady)
	if err != nil {
		t.Fatalf("static pod %s/%s not Ready: %v; %s; events: %s", ns, name, err, describe(p), podEvents(ctx, ns, node.MirrorPodName(name)))
	}
	return p, time.Since(start)
}

// removeStaticPod removes the manifest and waits until the kubelet deleted
// the mirror pod (and so stopped the pod).
func removeStaticPod(t *testing.T, ctx context.Context, ns, name string) {
	t.Helper()
	if err := node.RemoveStaticPod(name); err != nil {
		t.Error(err)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := nodeenv.Poll(ctx, "mirror pod of "+name+" gone", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, node.MirrorPodName(name), metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Error(err)
	}
}

// podEvents lists the reasons and messages of the Events about a pod.
func podEvents(ctx context.Context, ns, name string) string {
	evs, err := node.Env.CP.Admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, e := range evs.Items {
		out = append(out, e.Reason+": "+e.Message)
	}
	return strings.Join(out, "; ")
}

// staticPods: static pods from the kubelet's static pod directory (the
// kubelet runs them under their manifest hash, the API shows mirror pods
// with other uids). One in `default` starts as fast as an ordinary pod there
// (numbers printed), no sandbox ever failed, left alone. One in an ambient
// namespace is enrolled under its mirror pod's uid, its traffic captured;
// after the agent is SIGKILLed with its state file gone (only the /proc
// scan can find it: the pod's cgroup names the static uid) the restarted
// agent Adds it again with the same netns and it stays enabled; when its
// manifest is removed ztunnel drops it.
func (r *agentRun) staticPods(t *testing.T, ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()

	// `default`, as monitoring agents and node-local caches run.
	plainStart := time.Now()
	deletePod := func() {
		_ = node.Env.CP.Admin.CoreV1().Pods("default").Delete(context.Background(), "ordinary", metav1.DeleteOptions{})
	}
	t.Cleanup(deletePod)
	if _, err := node.Env.CP.Admin.CoreV1().Pods("default").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "ordinary"}, Spec: appPodSpec()}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := waitPod(ctx, "default", "ordinary", podReady); err != nil {
		t.Fatal(err)
	}
	plainTook := time.Since(plainStart)
	deletePodsAndWait(t, ctx, "default", metav1.ListOptions{FieldSelector: "metadata.name=ordinary"})
	mirror, took := startStaticPod(t, ctx, "default", "node-cache")
	t.Logf("create -> Ready in default: static pod %s, ordinary pod %s (one run each; the machine is shared)", took.Round(time.Millisecond), plainTook.Round(time.Millisecond))
	static := mirror.Annotations[podmeta.AnnotationConfigMirror]
	if static == "" || static == string(mirror.UID) {
		t.Fatalf("mirror pod %s: config.mirror %q, uid %s: not what the kubelet makes", mirror.Name, static, mirror.UID)
	}
	if evs := podEvents(ctx, "default", mirror.Name); strings.Contains(evs, "FailedCreatePodSandBox") {
		t.Errorf("the static pod's sandbox failed on the way: %s", evs)
	}
	if v, ok := mirror.Annotations[podmeta.AnnotationRedirection]; ok {
		t.Errorf("static pod out of the mesh annotated %q", v)
	}
	removeStaticPod(t, ctx, "default", "node-cache")

	// In the mesh.
	ns := ambientNamespace(t, ctx, "ambient-static")
	before, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mirror, took = startStaticPod(t, ctx, ns, "meshed")
	uid := string(mirror.UID)
	t.Logf("static pod in the mesh: manifest -> Ready %s; API uid %s, runtime uid %s", took.Round(time.Millisecond), uid, mirror.Annotations[podmeta.AnnotationConfigMirror])
	mirror, err = waitPod(ctx, ns, mirror.Name, func(p *corev1.Pod) bool { return p.Annotations[podmeta.AnnotationRedirection] == "enabled" })
	if err != nil {
		t.Fatalf("static pod in the mesh not enabled: %v; %s; events: %s", err, describe(mirror), podEvents(ctx, ns, mirror.Name))
	}
	after, err := node.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	netnsPath := newNetns(t, before, after)
	want := inode(t, netnsPath)
	st := r.waitEmu(t, ctx, "workload "+uid, func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return ok })
	if w, _ := st.Workload(uid); w.NetnsInode != want || w.Name != mirror.Name || w.Namespace != ns {
		t.Errorf("ztunnel workload %+v: want %s/%s in netns inode %d", w, ns, mirror.Name, want)
	}
	if _, ok := st.Workload(mirror.Annotations[podmeta.AnnotationConfigMirror]); ok {
		t.Error("ztunnel got the static uid as a workload")
	}
	outDst := netip.AddrPortFrom(node.IP, 9).String()
	dialFrom(t, ctx, netnsPath, outDst)
	r.waitEmu(t, ctx, "the static pod's outbound connection on 15001", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 && a.OrigDst == outDst })
	})

	// The node's own tools read what the agent wrote over netlink, on the
	// node and in the pod (nftables metadata an older nft cannot parse
	// once crashed it: istio/istio#58492).
	hostTablesReadable(t, ctx, "", "istio-inpod-probes-v4")
	hostTablesReadable(t, ctx, netnsPath, "istio-ambient-nat")

	// The agent restarts with only the /proc scan to find the pod.
	agentPod, err := node.AgentPod(ctx)
	if err != nil || agentPod == nil {
		t.Fatalf("agent pod: %v", err)
	}
	restarts := agentPod.Status.ContainerStatuses[0].RestartCount
	if err := r.em.State(ctx, &st); err != nil {
		t.Fatal(err)
	}
	conns := len(st.Connections)
	pid := agentProcess(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join("/var/run/ambientd", "pods.json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := nodeenv.Poll(ctx, "the agent restarted and Ready", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		p, err := node.AgentPod(ctx)
		return err == nil && p != nil && len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].RestartCount > restarts && podReady(p), err
	}); err != nil {
		t.Fatal(err)
	}
	st = r.waitEmu(t, ctx, "the restarted agent's snapshot", func(s ztunnelemu.State) bool {
		return len(s.Connections) > conns && s.Connections[len(s.Connections)-1].SnapshotSent
	})
	c := st.Connections[len(st.Connections)-1]
	var op string
	var got uint64
	for _, q := range st.RequestsOn(c.ID) {
		if q.UID == uid {
			op, got = q.Op, q.NetnsInode
		}
	}
	if op != "add" || got != want {
		t.Errorf("after the restart ztunnel got %q for the static pod with netns inode %d, want an Add with %d (found by the /proc scan)", op, got, want)
	}
	if p, err := node.Env.CP.Admin.CoreV1().Pods(ns).Get(ctx, mirror.Name, metav1.GetOptions{}); err != nil || p.Annotations[podmeta.AnnotationRedirection] != "enabled" || !podReady(p) {
		t.Errorf("static pod after the restart: %s (%v)", describe(p), err)
	}

	// The manifest goes: the kubelet stops the pod (CNI DEL with the
	// static uid) and deletes the mirror pod; ztunnel drops it.
	removeStaticPod(t, ctx, ns, "meshed")
	r.waitEmu(t, ctx, "ztunnel dropped the static pod", func(s ztunnelemu.State) bool { _, ok := s.Workload(uid); return !ok })
}

// hostTablesReadable runs this machine's `nft list ruleset` and
// iptables-nft-save in the node netns (netnsPath "") or a pod's: both must
// exit 0, and nft must show want.
func hostTablesReadable(t *testing.T, ctx context.Context, netnsPath, want string) {
	t.Helper()
	for _, args := range [][]string{{"nft", "list", "ruleset"}, {"nft", "-j", "list", "ruleset"}, {"iptables-nft-save"}, {"ip6tables-nft-save"}} {
		if netnsPath != "" {
			args = append([]string{"nsenter", "--net=" + netnsPath, "--"}, args...)
		}
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err != nil {
			t.Errorf("%s: %v\n%s", strings.Join(args, " "), err, out)
			continue
		}
		if args[len(args)-1] == "ruleset" && !strings.Contains(string(out), want) {
			t.Errorf("%s does not show %s:\n%s", strings.Join(args, " "), want, out)
		}
	}
}
