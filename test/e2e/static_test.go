//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// staticUID is a static pod's uid as the kubelet makes it (an md5 hex of
// the manifest): what the runtime passes to the CNI chain and names the
// sandbox's cgroup after, while the API shows the mirror pod's own uid.
const staticUID = "3f5a0c1e9b7d4a2c8e6f1b3d5a7c9e0f"

// TestStaticPodOutOfMesh: a static pod in a namespace out of the mesh starts
// through the real CNI chain with our plugin in it — not failed after the
// pod lookup for carrying the runtime's uid — and is left alone; as is one
// whose mirror pod never reached the API.
func TestStaticPodOutOfMesh(t *testing.T) {
	s := newScenario(t, "static-plain", plainNamespace())
	ctx := s.ctx
	plain := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "plain"})
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "dns-cache-" + testEnv.NodeName, StaticUID: staticUID})
	t.Logf("CNI ADD through the chain: static pod %v, ordinary pod %v (machine shared, not a benchmark)", p.AddDuration, plain.AddDuration)
	if v, ok := annotationOf(t, ctx, p); ok {
		t.Errorf("static pod out of the mesh annotated %q", v)
	}
	if _, ok := emuState(t, ctx, s.em).Workload(p.UID); ok {
		t.Error("static pod out of the mesh reached ztunnel")
	}

	// The kubelet could not create the mirror pod: the sandbox still
	// starts (only the runtime's part runs; no API object).
	obj := p.Object.DeepCopy()
	obj.Name, obj.UID = "orphan", "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b"
	orphan, err := testEnv.AttachPod(ctx, obj, nil)
	if err != nil {
		t.Fatalf("static pod with no mirror pod: %v", err)
	}
	if err := testEnv.DeletePod(ctx, orphan); err != nil {
		t.Errorf("tear the orphan down: %v", err)
	}
}

// TestStaticPodInMesh: a static pod in an ambient namespace is enrolled
// under its mirror pod's uid (the one the API and ztunnel agree on) and its
// traffic captured; after an agent restart without its state file (so only
// the /proc scan can find it: its cgroup names the static uid) it is Added
// again with the same netns and stays enabled; when the kubelet tears it
// down (DEL with the static uid, mirror pod deleted) ztunnel drops it.
func TestStaticPodInMesh(t *testing.T) {
	s := newScenario(t, "static-mesh", within(5*time.Minute))
	ctx, em := s.ctx, s.em
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: s.ns, Name: "agent-" + testEnv.NodeName, StaticUID: staticUID})
	if p.UID == staticUID || p.RuntimeUID != staticUID {
		t.Fatalf("test setup: API uid %s, runtime uid %s", p.UID, p.RuntimeUID)
	}
	waitAnnotation(t, ctx, p, "enabled")
	st := waitEmu(t, ctx, em, "workload "+p.UID, func(s ztunnelemu.State) bool { _, ok := s.Workload(p.UID); return ok })
	if _, ok := st.Workload(staticUID); ok {
		t.Error("ztunnel got the static uid as a workload")
	}
	if w, _ := st.Workload(p.UID); w.NetnsInode != netnsInode(t, p) || w.Name != p.Name {
		t.Errorf("workload %+v: want pod %s in netns inode %d", w, p.Name, netnsInode(t, p))
	}
	dst := outsideAddr()
	conn, err := p.Dial(ctx, "tcp", dst)
	if err != nil {
		t.Fatalf("dial from the static pod: %v", err)
	}
	conn.Close()
	waitEmu(t, ctx, em, "static pod's connection captured", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(r ztunnelemu.AcceptRecord) bool { return r.UID == p.UID && r.OrigDst == dst })
	})

	if err := s.agent.Kill(); err != nil {
		t.Fatalf("SIGKILL agent: %v", err)
	}
	if err := os.Remove(filepath.Join(testEnv.AgentRunDir, "pods.json")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	st, c := startAndAwaitSnapshot(t, ctx, s.agent, em)
	if got, want := addInodes(st, c)[p.UID], netnsInode(t, p); got != want {
		t.Errorf("first snapshot after the restart: Add of the static pod with netns inode %d, want %d (snapshot %+v)", got, want, c.Snapshot)
	}
	if countOps(st, "del", p.UID) != 0 {
		t.Error("the static pod was Deleted from ztunnel across the restart")
	}
	if v, _ := annotationOf(t, ctx, p); v != "enabled" {
		t.Errorf("annotation after the restart %q", v)
	}

	if err := testEnv.DeletePod(ctx, p); err != nil {
		t.Fatalf("delete the static pod: %v", err)
	}
	testutil.Until(t, ctx, "ztunnel drops the static pod", func() bool {
		_, ok := emuState(t, ctx, em).Workload(p.UID)
		return !ok
	})
}
