package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/nodeagent/agent"
)

// TestCNI11StatusAndGC: on a node whose network is a cniVersion 1.1.0
// conflist (containerd 2.x calls STATUS on it every few seconds, and GC),
// the installer puts our entry last without changing the list's version,
// and through libcni with the real bridge and host-local: STATUS succeeds
// with the agent up, with no agent on the socket, and with an agent that
// never answers (STATUS does not ask it, so an agent restart never makes
// the runtime report the network not ready); GC with a list of valid
// attachments succeeds, releases only the stale pod (the agent told of its
// DEL, never of the live one's) and keeps the live pod's address.
func TestCNI11StatusAndGC(t *testing.T) {
	forEachInstallMode(t, testCNI11StatusAndGC)
}

func testCNI11StatusAndGC(t *testing.T, inPlace bool) {
	hostNS := newNS(t)
	live, stale := newNS(t), newNS(t)
	ipamDir := t.TempDir()
	sock := filepath.Join(t.TempDir(), "run", "cni.sock")
	ag := &fakeAgent{outcome: agent.Enrolled}
	stopAgent := serveAgent(t, ag, sock)
	primary := fmt.Sprintf(`{
  "cniVersion": "1.1.0",
  "cniVersions": ["1.0.0", "1.1.0"],
  "name": "node-net",
  "plugins": [
    {"type": "bridge", "bridge": "amb-gc0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": "10.88.11.0/24"}]]}}
  ]
}
`, ipamDir)
	hostBin, confDir, inst := installOnNode(t, "10-node.conflist", primary, sock, inPlace)

	list := runtimeList(t, confDir)
	kinds := make([]string, 0, len(list.Plugins))
	for _, p := range list.Plugins {
		kinds = append(kinds, p.Network.Type)
	}
	if list.CNIVersion != "1.1.0" || !slices.Equal(kinds, []string{"bridge", "ambientd-cni"}) {
		t.Fatalf("runtime's network: cniVersion %q, plugins %v; want 1.1.0, [bridge ambientd-cni]", list.CNIVersion, kinds)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{hostBin, binDir}, t.TempDir(), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vi, err := cni.GetVersionInfo(ctx, "ambientd-cni")
	if err != nil || !slices.Contains(vi.SupportedVersions(), "1.1.0") {
		t.Fatalf("installed plugin's VERSION: %v (%v), want 1.1.0 among them", vi, err)
	}
	inHost := func(f func() error) error {
		return hostNS.Do(func(ns.NetNS) error { return f() })
	}
	rt := func(uid string, netns ns.NetNS) *libcni.RuntimeConf {
		return &libcni.RuntimeConf{ContainerID: "infra-" + uid, NetNS: netns.Path(), IfName: "eth0", Args: [][2]string{
			{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "shop"}, {"K8S_POD_NAME", "web-" + uid},
			{"K8S_POD_INFRA_CONTAINER_ID", "infra-" + uid}, {"K8S_POD_UID", uid},
		}}
	}
	add := func(uid string, netns ns.NetNS) string {
		var res types.Result
		if err := inHost(func() (err error) { res, err = cni.AddNetworkList(ctx, list, rt(uid, netns)); return err }); err != nil {
			t.Fatalf("ADD %s through the chain: %v", uid, err)
		}
		cur, err := current.NewResultFromResult(res)
		if err != nil || len(cur.IPs) != 1 {
			t.Fatalf("ADD %s result %v (%v): want one address", uid, res, err)
		}
		return cur.IPs[0].Address.IP.String()
	}
	status := func(when string) {
		t.Helper()
		// Bounded well below the entry's 30s timeout: a STATUS that asked an
		// agent which never answers would not return in time.
		sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
		defer scancel()
		if err := inHost(func() error { return cni.GetStatusNetworkList(sctx, list) }); err != nil {
			t.Errorf("STATUS %s: %v", when, err)
		}
	}
	reserved := func(ip string) bool {
		_, err := os.Stat(filepath.Join(ipamDir, "node-net", ip))
		return err == nil
	}

	liveIP, staleIP := add("live", live), add("stale", stale)
	if adds, _ := ag.events(); len(adds) != 2 {
		t.Fatalf("agent got %d ADDs, want 2", len(adds))
	}
	status("with the agent up")

	stopAgent()
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("agent's socket still there after it stopped: %v", err)
	}
	status("with no agent on the socket")

	silent := &fakeAgent{block: true}
	stopSilent := serveAgent(t, silent, sock)
	status("with an agent that never answers")
	if adds, dels := silent.events(); len(adds)+len(dels) != 0 {
		t.Errorf("STATUS reached the agent: %d ADDs, %d DELs", len(adds), len(dels))
	}
	stopSilent()

	// GC: the runtime knows only the live pod. libcni DELs the stale
	// attachment through the chain (our DEL tells the agent), then every
	// plugin gets GC with the valid attachments.
	back := &fakeAgent{outcome: agent.Enrolled}
	serveAgent(t, back, sock)
	valid := []types.GCAttachment{{ContainerID: "infra-live", IfName: "eth0"}}
	if err := inHost(func() error { return cni.GCNetworkList(ctx, list, &libcni.GCArgs{ValidAttachments: valid}) }); err != nil {
		t.Fatalf("GC through the chain: %v", err)
	}
	adds, dels := back.events()
	if len(adds) != 0 || len(dels) != 1 || dels[0].UID != "stale" {
		t.Errorf("after GC the agent got ADDs %+v, DELs %+v; want only a DEL of the stale pod", adds, dels)
	}
	if !reserved(liveIP) || reserved(staleIP) {
		t.Errorf("after GC host-local holds live %s: %v, stale %s: %v; want only the live one", liveIP, reserved(liveIP), staleIP, reserved(staleIP))
	}
	status("after GC")

	if err := inHost(func() error { return cni.DelNetworkList(ctx, list, rt("live", live)) }); err != nil {
		t.Fatalf("DEL of the live pod: %v", err)
	}
	if err := inst.Uninstall(); err != nil {
		t.Fatal(err)
	}
}
