//go:build e2e

package e2e

// End-to-end tests of the node agent: bin/ambientd against the real
// kube-apiserver + etcd, pods created through the real CNI chain with our
// plugin last, and bin/ztunnel-emulator in netns mode standing in for ztunnel.

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// TestAgentEnrollsNewPod: a pod of an ambient namespace created through the
// CNI chain reaches ztunnel with its identity and netns, gets `enabled`, and
// its outbound TCP lands on ztunnel's 15001 with the original destination.
func TestAgentEnrollsNewPod(t *testing.T) {
	s := newScenario(t, "enroll")
	ctx, nsName, em := s.ctx, s.ns, s.em

	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "web", ServiceAccount: "web-sa"})
	waitAnnotation(t, ctx, p, "enabled")

	st := waitEmu(t, ctx, em, "workload "+p.UID, func(s ztunnelemu.State) bool { _, ok := s.Workload(p.UID); return ok })
	w, _ := st.Workload(p.UID)
	if w.Name != "web" || w.Namespace != nsName || w.ServiceAccount != "web-sa" {
		t.Errorf("emulator workload %+v: want name web, namespace %s, service account web-sa", w, nsName)
	}
	if want := netnsInode(t, p); w.NetnsInode != want {
		t.Errorf("emulator got netns inode %d, pod netns is %d", w.NetnsInode, want)
	}
	rules := podRules(t, p)
	if !strings.Contains(rules, "ISTIO_OUTPUT") || !strings.Contains(rules, "ISTIO_PRERT") {
		t.Errorf("in-pod rules missing:\n%s", rules)
	}
	// DNS capture is the agent's default (as in Istio since 1.25).
	if !strings.Contains(rules, "--to-ports 15053") {
		t.Errorf("DNS not captured by default:\n%s", rules)
	}

	dst := outsideAddr()
	conn, err := p.Dial(ctx, "tcp", dst)
	if err != nil {
		t.Fatalf("dial from pod: %v", err)
	}
	conn.Close()
	st = waitEmu(t, ctx, em, "accepted connection from the pod", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(r ztunnelemu.AcceptRecord) bool { return r.UID == p.UID })
	})
	for _, r := range st.Accepted {
		if r.UID != p.UID {
			continue
		}
		if r.Port != 15001 || r.OrigDst != dst {
			t.Errorf("accepted %+v: want port 15001 and original destination %s", r, dst)
		}
	}
}

// TestAgentPendingUntilZtunnel: with no ztunnel the ADD succeeds (documented
// policy), the pod is `pending` with its rules in place; when ztunnel
// connects it becomes `enabled` within a second, without any pod update.
func TestAgentPendingUntilZtunnel(t *testing.T) {
	// A backoff far longer than the test: only the agent's reaction to the
	// ztunnel snapshot can enable the pod in time.
	s := newScenario(t, "pending", withoutZtunnel(), agentArgs("--retry-base-delay=10m", "--retry-max-delay=10m"))
	ctx, nsName, a := s.ctx, s.ns, s.agent

	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "early"})
	obj := waitPodAnnotationObj(t, ctx, p, "pending")
	if rules := podRules(t, p); !strings.Contains(rules, "ISTIO_OUTPUT") {
		t.Errorf("pending pod has no rules:\n%s", rules)
	}

	em := startEmulator(t, ctx, "ztunnel-late")
	var connectedAt time.Time
	waitEmu(t, ctx, em, "snapshot sent", func(s ztunnelemu.State) bool {
		for _, c := range s.Connections {
			if c.SnapshotSent {
				if connectedAt.IsZero() {
					connectedAt = time.Now()
				}
				return true
			}
		}
		return false
	})
	enabled := waitPodAnnotationObj(t, ctx, p, "enabled")
	t.Logf("pending → enabled within %v of the emulator's snapshot as seen by the test (includes polling)", time.Since(connectedAt))
	// The agent's own measure, from the snapshot ack to the pod enabled. The
	// bound is generous (a loaded machine must not fail it); the figure is
	// what to look at.
	n := metricValue(t, ctx, a, "ambientd_snapshot_ack_to_enabled_seconds_count", "")
	sum := metricValue(t, ctx, a, "ambientd_snapshot_ack_to_enabled_seconds_sum", "")
	if n < 1 {
		t.Fatalf("agent measured no snapshot-ack → enabled move (count %v)", n)
	}
	took := time.Duration(sum / n * float64(time.Second))
	t.Logf("pending → enabled %v after the snapshot ack (agent's measure, %v pods)", took, n)
	if took > 5*time.Second {
		t.Errorf("pod took %v after ztunnel's snapshot ack to become enabled; want well under 5s (the backoff is 10m: only the ack can enable it)", took)
	}
	// No pod update between pending and enabled other than the annotation.
	if enabled.Generation != obj.Generation || !maps.Equal(enabled.Labels, obj.Labels) {
		t.Errorf("pod spec/labels changed between pending and enabled")
	}
}

// TestAgentLabelsEnrollAndRemoveRunningPods: labelling a namespace enrolls its
// running pods (netns found by the agent's scan of the real /proc, through
// the pods' sandbox processes); unlabelling, or a pod's
// `none`, removes them completely. hostNetwork, kube-system and sidecar pods
// are never touched.
func TestAgentLabelsEnrollAndRemoveRunningPods(t *testing.T) {
	s := newScenario(t, "labels", within(5*time.Minute), plainNamespace())
	ctx, nsName, em := s.ctx, s.ns, s.em

	p1 := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "one"})
	p2 := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "two"})
	sidecar := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "sidecar", Annotations: map[string]string{annSidecar: "{}"}})
	hostNet := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "hostnet", Mutate: func(p *corev1.Pod) { p.Spec.HostNetwork = true }})
	sys := createPod(t, ctx, e2eenv.PodSpec{Namespace: "kube-system", Name: uniqueNS("sys"), Labels: map[string]string{labelMode: "ambient"}})
	never := []*e2eenv.Pod{sidecar, hostNet, sys}
	for _, p := range append([]*e2eenv.Pod{p1, p2}, never...) {
		if p.SandboxPid() == 0 {
			t.Fatalf("pod %s has no sandbox process", p.Name)
		}
		if v, ok := annotationOf(t, ctx, p); ok {
			t.Fatalf("pod %s annotated %q before any label", p.Name, v)
		}
	}

	setNamespaceMode(t, ctx, nsName, "ambient")
	for _, p := range []*e2eenv.Pod{p1, p2} {
		waitAnnotation(t, ctx, p, "enabled")
		if rules := podRules(t, p); !strings.Contains(rules, "ISTIO_OUTPUT") {
			t.Errorf("pod %s enrolled without rules:\n%s", p.Name, rules)
		}
	}
	st := emuState(t, ctx, em)
	for _, p := range []*e2eenv.Pod{p1, p2} {
		w, ok := st.Workload(p.UID)
		if !ok || w.NetnsInode != netnsInode(t, p) {
			t.Errorf("emulator workload for %s: %+v (found %v), want netns inode %d", p.Name, w, ok, netnsInode(t, p))
		}
	}

	// A pod's own `none` removes just that pod.
	setPodMode(t, ctx, p2, "none")
	waitNoAnnotation(t, ctx, p2)
	waitEmu(t, ctx, em, "Del of "+p2.Name, func(s ztunnelemu.State) bool { return countOps(s, "del", p2.UID) > 0 })
	if rules := podRules(t, p2); rules != "" {
		t.Errorf("pod %s left the mesh but has rules:\n%s", p2.Name, rules)
	}
	if v, _ := annotationOf(t, ctx, p1); v != "enabled" {
		t.Errorf("pod %s annotation %q after its neighbour opted out", p1.Name, v)
	}

	// Unlabelling the namespace removes the rest.
	setNamespaceMode(t, ctx, nsName, "")
	waitNoAnnotation(t, ctx, p1)
	st = waitEmu(t, ctx, em, "Del of "+p1.Name, func(s ztunnelemu.State) bool { return countOps(s, "del", p1.UID) > 0 })
	if rules := podRules(t, p1); rules != "" {
		t.Errorf("pod %s left the mesh but has rules:\n%s", p1.Name, rules)
	}
	if _, ok := st.Workload(p1.UID); ok {
		t.Errorf("emulator still serves %s", p1.Name)
	}

	for _, p := range never {
		if v, ok := annotationOf(t, ctx, p); ok {
			t.Errorf("pod %s/%s must never be touched, has %s=%q", p.Namespace, p.Name, annRedirect, v)
		}
		if countOps(st, "add", p.UID) != 0 {
			t.Errorf("pod %s/%s reached ztunnel", p.Namespace, p.Name)
		}
		if rules := podRules(t, p); rules != "" {
			t.Errorf("pod %s/%s has rules:\n%s", p.Namespace, p.Name, rules)
		}
	}
}

// TestAgentDeleteAndReconnect: deleting a pod sends Del to every connected
// ztunnel; a ztunnel that connects afterwards gets exactly the live pods.
func TestAgentDeleteAndReconnect(t *testing.T) {
	s := newScenario(t, "delete")
	ctx, nsName, em1 := s.ctx, s.ns, s.em
	em2 := startEmulator(t, ctx, "ztunnel-del-2")
	waitEmu(t, ctx, em2, "second ztunnel snapshot", func(s ztunnelemu.State) bool {
		return s.Connected && len(s.Connections) > 0 && s.Connections[len(s.Connections)-1].SnapshotSent
	})

	keep := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "keep"})
	gone := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "gone"})
	waitAnnotation(t, ctx, keep, "enabled")
	waitAnnotation(t, ctx, gone, "enabled")

	if err := testEnv.DeletePod(ctx, gone); err != nil {
		t.Fatal(err)
	}
	for _, em := range []*e2eenv.Emulator{em1, em2} {
		waitEmu(t, ctx, em, "Del of the deleted pod", func(s ztunnelemu.State) bool { return countOps(s, "del", gone.UID) > 0 })
	}

	// Reconnect: the newest emulator restarts and must get exactly the live
	// pods of this node (every pod the agent has annotated).
	if err := em2.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	em3 := startEmulator(t, ctx, "ztunnel-del-3")
	st := waitEmu(t, ctx, em3, "snapshot", func(s ztunnelemu.State) bool {
		return len(s.Connections) > 0 && s.Connections[0].SnapshotSent
	})
	var got []string
	for _, it := range st.Connections[0].Snapshot {
		got = append(got, it.UID)
	}
	want := annotatedUIDs(t, ctx)
	sort.Strings(got)
	if !slices.Equal(got, want) {
		t.Errorf("reconnect snapshot %v, want the live pods %v", got, want)
	}
	if slices.Contains(got, gone.UID) || !slices.Contains(got, keep.UID) {
		t.Errorf("snapshot %v: must hold %s and not the deleted %s", got, keep.UID, gone.UID)
	}
}

// TestAgentNackKeepsPodPending: ztunnel refusing one pod leaves it pending and
// retried; other pods are unaffected; once accepted it becomes enabled.
func TestAgentNackKeepsPodPending(t *testing.T) {
	s := newScenario(t, "nack")
	ctx, nsName, em := s.ctx, s.ns, s.em
	if err := em.SetNack(ctx, nsName+"/refused", "netns setup failed"); err != nil {
		t.Fatal(err)
	}
	refused := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "refused"})
	fine := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "fine"})
	waitAnnotation(t, ctx, refused, "pending")
	waitAnnotation(t, ctx, fine, "enabled")
	// Retried: more than one Add arrives while it is refused.
	waitEmu(t, ctx, em, "retried Adds of the refused pod", func(s ztunnelemu.State) bool { return countOps(s, "add", refused.UID) >= 3 })
	if v, _ := annotationOf(t, ctx, refused); v != "pending" {
		t.Errorf("refused pod annotation %q while nacked, want pending", v)
	}
	if err := em.ClearNack(ctx, nsName+"/refused"); err != nil {
		t.Fatal(err)
	}
	waitAnnotation(t, ctx, refused, "enabled")
	if v, _ := annotationOf(t, ctx, fine); v != "enabled" {
		t.Errorf("other pod annotation %q, want enabled", v)
	}
}

// TestAgentAPIServerDown: with the kube-apiserver stopped, a new pod still
// gets its rules and reaches ztunnel; its annotation lands once the API is
// back.
func TestAgentAPIServerDown(t *testing.T) {
	s := newScenario(t, "apidown", within(6*time.Minute))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	cachedBefore := informerPods(t, ctx, a)
	obj := createObjectOnly(t, ctx, nsName, "offline")
	// The agent's cache must know the pod before the API goes away.
	testutil.Until(t, ctx, "agent cache has the new pod", func() bool { return informerPods(t, ctx, a) > cachedBefore })

	restartAPIServer := stopAPIServer(t, ctx)

	netns, err := e2eenv.NewNetns(filepath.Join(testEnv.Dir, "netns"), nsName+"_offline")
	if err != nil {
		t.Fatal(err)
	}
	att := e2eenv.Attachment{ContainerID: "e2e-offline", NetnsPath: netns.Path(), PodName: "offline", PodNamespace: nsName, PodUID: string(obj.UID)}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = testEnv.Chain.Del(cctx, att)
		_ = e2eenv.DeleteNetns(netns)
	})
	if _, err := testEnv.Chain.Add(ctx, att); err != nil {
		t.Fatalf("CNI ADD with the API down: %v", err)
	}
	waitEmu(t, ctx, em, "Add of the pod created while the API is down", func(s ztunnelemu.State) bool { _, ok := s.Workload(string(obj.UID)); return ok })
	pod := &e2eenv.Pod{Namespace: nsName, Name: "offline", UID: string(obj.UID), Netns: netns, NetnsPath: netns.Path()}
	if rules := podRules(t, pod); !strings.Contains(rules, "ISTIO_OUTPUT") {
		t.Errorf("no rules in the pod programmed while the API was down:\n%s", rules)
	}

	restartAPIServer()
	waitAnnotation(t, ctx, pod, "enabled")
}

// TestAgentBadInput: a CNI event for a pod the API does not know, an invalid
// interface annotation and a netns path that does not exist each fail with a
// clear error, are counted, and leak no rules or registry entries.
func TestAgentBadInput(t *testing.T) {
	s := newScenario(t, "bad", agentArgs("--pod-lookup-timeout=2s"))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent

	// 1. Unknown pod: run the chain for a pod that has no API object.
	ghostNS, err := e2eenv.NewNetns(filepath.Join(testEnv.Dir, "netns"), nsName+"_ghost")
	if err != nil {
		t.Fatal(err)
	}
	ghost := e2eenv.Attachment{ContainerID: "e2e-ghost", NetnsPath: ghostNS.Path(), PodName: "ghost", PodNamespace: nsName, PodUID: "00000000-0000-0000-0000-00000000dead"}
	t.Cleanup(func() {
		_ = testEnv.Chain.Del(context.Background(), ghost)
		_ = e2eenv.DeleteNetns(ghostNS)
	})
	start := time.Now()
	_, err = testEnv.Chain.Add(ctx, ghost)
	if err == nil || !strings.Contains(err.Error(), "not found") {
		t.Errorf("CNI ADD of an unknown pod: err = %v, want a not-found error", err)
	}
	t.Logf("unknown pod rejected after %v: %v", time.Since(start), err)
	ghostPod := &e2eenv.Pod{Namespace: nsName, Name: "ghost", Netns: ghostNS, NetnsPath: ghostNS.Path()}
	if rules := podRules(t, ghostPod); rules != "" {
		t.Errorf("unknown pod got rules:\n%s", rules)
	}

	// 2. An invalid interface annotation: CreatePod fails (and cleans up).
	// (An invalid boolean is ignored, as Istio does, with an Event:
	// TestAnnotationsParsedLikeIstio.)
	_, err = testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: "badtap", Annotations: map[string]string{"istio.io/reroute-virtual-interfaces": "tap 0"}})
	if err == nil || !strings.Contains(err.Error(), "reroute-virtual-interfaces") {
		t.Errorf("pod with reroute-virtual-interfaces=\"tap 0\": err = %v, want an error naming the annotation", err)
	}

	// 3. A netns path that does not exist, for a pod the API knows. The
	// bridge plugin would reject the path before ours runs, so the plugin is
	// exec'd directly as the last plugin of a chain, with a prevResult.
	missing := createObjectOnly(t, ctx, nsName, "nonetns")
	out, err := runPluginAdd(ctx, missing, "/var/run/netns/does-not-exist")
	if err == nil || !strings.Contains(out+err.Error(), "does-not-exist") {
		t.Errorf("CNI ADD with a missing netns: err = %v, output %s; want an error naming the path", err, out)
	}

	for _, r := range []string{`reason="pod_unknown"`, `reason="bad_annotation"`, `reason="netns"`} {
		if v := metricValue(t, ctx, a, "ambientd_failures_total", r); v < 1 {
			t.Errorf("ambientd_failures_total{%s} = %v, want ≥ 1", r, v)
		}
	}
	var held float64
	for _, ph := range []string{"pending", "unverified", "enabled", "uncaptured"} {
		held += metricValue(t, ctx, a, "ambientd_pods", `phase="`+ph+`"`)
	}
	if v := held; v != float64(len(annotatedUIDs(t, ctx))) {
		t.Errorf("registry holds %v pods, the node has %d enrolled: an entry leaked", v, len(annotatedUIDs(t, ctx)))
	}
	st := emuState(t, ctx, em)
	for _, r := range st.Requests {
		if r.Op == "add" && r.Namespace == nsName {
			t.Errorf("bad input reached ztunnel: %+v", r)
		}
	}
}

// TestAgentEnrollmentLoad enrolls 20 pods, 4 at a time, and reports numbers
// (no timing assertions): CNI chain time per pod (netns, bridge, host-local,
// our plugin → agent → rules + ztunnel ack) and create → `enabled` time.
func TestAgentEnrollmentLoad(t *testing.T) {
	const pods, parallel = 20, 4
	s := newScenario(t, "load", within(6*time.Minute))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	type result struct {
		pod            *e2eenv.Pod
		create, enable time.Duration
		err            error
	}
	results := make(chan result, pods)
	sem := make(chan struct{}, parallel)
	start := time.Now()
	for i := range pods {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			t0 := time.Now()
			p, err := testEnv.CreatePod(ctx, e2eenv.PodSpec{Namespace: nsName, Name: fmt.Sprintf("load-%02d", i)})
			if err != nil {
				results <- result{err: err}
				return
			}
			create := time.Since(t0)
			_, err = testEnv.WaitForPodAnnotation(ctx, p.Namespace, p.Name, annRedirect, "enabled")
			results <- result{pod: p, create: create, enable: time.Since(t0), err: err}
		}()
	}
	var creates, enables []time.Duration
	for range pods {
		r := <-results
		if r.pod != nil {
			t.Cleanup(func() {
				cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				_ = testEnv.DeletePod(cctx, r.pod)
			})
		}
		if r.err != nil {
			t.Errorf("pod: %v", r.err)
			continue
		}
		creates = append(creates, r.create)
		enables = append(enables, r.enable)
	}
	wall := time.Since(start)
	if t.Failed() {
		return
	}
	st := emuState(t, ctx, em)
	n := 0
	for _, w := range st.Workloads {
		if w.Namespace == nsName {
			n++
		}
	}
	if n != pods {
		t.Errorf("emulator serves %d pods of %s, want %d", n, nsName, pods)
	}
	pct := func(d []time.Duration, p float64) time.Duration {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[int(float64(len(s)-1)*p)].Round(time.Millisecond)
	}
	t.Logf("%d pods, %d at a time: wall %v (%.1f pods/s); CNI chain per pod p50 %v p95 %v max %v; create→enabled p50 %v p95 %v max %v",
		pods, parallel, wall.Round(time.Millisecond), float64(pods)/wall.Seconds(),
		pct(creates, .5), pct(creates, .95), pct(creates, 1), pct(enables, .5), pct(enables, .95), pct(enables, 1))
	if m, err := a.Metrics(ctx); err == nil {
		for _, l := range strings.Split(m, "\n") {
			if strings.HasPrefix(l, "ambientd_enrollment_step_duration_seconds_sum") || strings.HasPrefix(l, "ambientd_enrollment_step_duration_seconds_count") {
				t.Log(l)
			}
		}
	}
}
