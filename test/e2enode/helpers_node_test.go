//go:build e2enode

package e2enode

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	criv1 "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// overlay writes the agent's kustomize overlay (nodeenv.WriteAgentOverlay)
// into a temp dir and returns it.
func overlay(t *testing.T, tag string) string {
	t.Helper()
	dir, err := node.WriteAgentOverlay(t.TempDir(), tag)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func agentImageArchive(t *testing.T) string {
	t.Helper()
	p, err := node.AgentImageArchive()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func conflist(t *testing.T) string {
	t.Helper()
	s, err := node.ConflistText()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// pluginInstalled reports whether the agent's plugin is in the CNI config
// containerd uses (the agent's own conflist or the primary's file).
func pluginInstalled(t *testing.T) bool {
	t.Helper()
	ok, err := node.PluginInstalled()
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// runtimeConfig is the name and text of the CNI config containerd uses.
func runtimeConfig(t *testing.T) string {
	t.Helper()
	name, text, err := node.RuntimeConfig()
	if err != nil {
		t.Fatal(err)
	}
	return name + ":\n" + text
}

// agentCNISocket is where the plugin reaches the agent (deploy/'s ConfigMap).
const agentCNISocket = "/run/ambientd/cni.sock"

// waitCNIUnserved waits until nothing answers on agentCNISocket: the old
// agent of a roll has stopped serving CNI (and the new one does not yet).
func waitCNIUnserved(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := nodeenv.Poll(ctx, "the old agent stops serving CNI", 20*time.Millisecond, func(ctx context.Context) (bool, error) {
		c, err := net.DialTimeout("unix", agentCNISocket, 100*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err != nil, nil
	}); err != nil {
		t.Fatal(err)
	}
}

func nodeTainted(ctx context.Context) (bool, error) { return node.Tainted(ctx, startupTaint) }

// newNetns returns the netns in after that is not in before (exactly one).
func newNetns(t *testing.T, before, after nodeenv.State) string {
	t.Helper()
	var added []string
	for _, n := range after.Netns {
		if !slices.Contains(before.Netns, n) {
			added = append(added, n)
		}
	}
	if len(added) != 1 {
		t.Fatalf("netns before %v, after %v: want exactly one more", before.Netns, after.Netns)
	}
	return filepath.Join(node.NetnsDir, added[0])
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	h, err := podnetns.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	return h.Inode()
}

// processIn finds the process named comm whose network namespace has the
// inode ino.
func processIn(t *testing.T, ino uint64, comm string) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if err != nil || strings.TrimSpace(string(c)) != comm {
			continue
		}
		if inodeOf(fmt.Sprintf("/proc/%d/ns/net", pid)) == ino {
			return pid
		}
	}
	t.Fatalf("no %s process in netns inode %d", comm, ino)
	return 0
}

func unixKill(pid int) error { return syscall.Kill(pid, syscall.SIGKILL) }

// removeDeadSandboxes removes the pod's not-ready sandboxes through
// containerd's CRI, as kubelet's garbage collection does, and returns when
// containerd answered.
func removeDeadSandboxes(t *testing.T, ctx context.Context, uid string) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+node.ContainerdAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rt := criv1.NewRuntimeServiceClient(conn)
	resp, err := rt.ListPodSandbox(ctx, &criv1.ListPodSandboxRequest{Filter: &criv1.PodSandboxFilter{
		State:         &criv1.PodSandboxStateValue{State: criv1.PodSandboxState_SANDBOX_NOTREADY},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": uid},
	}})
	if err != nil {
		t.Fatalf("CRI ListPodSandbox: %v", err)
	}
	if len(resp.Items) != 1 {
		t.Fatalf("pod %s has %d dead sandboxes, want 1: %v", uid, len(resp.Items), resp.Items)
	}
	for _, sb := range resp.Items {
		if _, err := rt.RemovePodSandbox(ctx, &criv1.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
			t.Fatalf("CRI RemovePodSandbox %s: %v", sb.Id, err)
		}
		t.Logf("removed dead sandbox %s through the CRI", sb.Id)
	}
}

// netnsByInode returns the path under the node's netns dir of the network
// namespace with inode ino.
func netnsByInode(t *testing.T, ino uint64) string {
	t.Helper()
	entries, err := os.ReadDir(node.NetnsDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if p := filepath.Join(node.NetnsDir, e.Name()); inodeOf(p) == ino {
			return p
		}
	}
	t.Fatalf("no netns with inode %d in %s", ino, node.NetnsDir)
	return ""
}

// inodeOf is the inode of path (0 when it cannot be read).
func inodeOf(path string) uint64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Ino
}

// nodeNFT runs nft in the node netns (where this test and the agent run).
func nodeNFT(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	out, err := exec.CommandContext(ctx, "nft", args...).CombinedOutput()
	return string(out), err
}

// hostProbeTable returns the node's nftables host table (probe SNAT chain
// and probe sets) and fails the test when the agent does not use the
// nftables backend here.
func hostProbeTable(t *testing.T, ctx context.Context) string {
	t.Helper()
	out, err := nodeNFT(t, ctx, "list", "table", "inet", "istio-ambient-nat")
	if err != nil {
		t.Fatalf("the node has no nftables host table (the scenario needs the nftables backend): %v: %s", err, out)
	}
	return out
}

// agentProcess is the pid of the agent's ambientd process on the node: the
// one in the node's netns (the DaemonSet runs in the host network; other
// ambientd processes on this machine belong to other environments).
func agentProcess(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	nodeNetns := inodeOf("/proc/self/ns/net")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && strings.TrimSpace(string(c)) == "ambientd" &&
			inodeOf(fmt.Sprintf("/proc/%d/ns/net", pid)) == nodeNetns {
			pids = append(pids, pid)
		}
	}
	if len(pids) != 1 {
		t.Fatalf("ambientd processes on the node: %v, want exactly one (the DaemonSet's)", pids)
	}
	return pids[0]
}
