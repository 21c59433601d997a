package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/nodeagent/agent"
)

// TestChainInstalledConfig runs the real chain from the config the installer
// wrote: the node's primary CNI has a single-plugin .conf (bridge +
// host-local), the installer copies the plugin into the "host" bin dir and
// writes its own conflist that sorts first (owned mode, the default) or
// turns the .conf into a conflist with our entry last (in-place mode), and
// libcni — loading the conf dir the way a runtime does — calls our plugin,
// which reaches the agent. After Uninstall the runtime's config no longer
// calls it and the .conf is as it was.
func TestChainInstalledConfig(t *testing.T) {
	forEachInstallMode(t, testChainInstalledConfig)
}

func testChainInstalledConfig(t *testing.T, inPlace bool) {
	hostNS := newNS(t)
	podNS := newNS(t)
	ag := &fakeAgent{outcome: agent.Enrolled}
	sock := startAgent(t, ag)
	primary := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "node-net",
  "type": "bridge", "bridge": "amb-inst0", "isGateway": true, "ipMasq": false,
  "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": "10.88.9.0/24"}]]}
}
`, t.TempDir())
	hostBin, confDir, inst := installOnNode(t, "10-node.conf", primary, sock, inPlace)

	// The runtime: plugins from the host bin dir first (ours is only
	// there), the reference plugins after.
	cni := libcni.NewCNIConfigWithCacheDir([]string{hostBin, binDir}, t.TempDir(), nil)
	rt := func(uid string) *libcni.RuntimeConf {
		return &libcni.RuntimeConf{ContainerID: "infra-" + uid, NetNS: podNS.Path(), IfName: "eth0", Args: [][2]string{
			{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "shop"}, {"K8S_POD_NAME", "web-" + uid},
			{"K8S_POD_INFRA_CONTAINER_ID", "infra-" + uid}, {"K8S_POD_UID", uid},
		}}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	chain := func(add bool, list *libcni.NetworkConfigList, uid string) error {
		return hostNS.Do(func(ns.NetNS) error {
			if add {
				_, err := cni.AddNetworkList(ctx, list, rt(uid))
				return err
			}
			return cni.DelNetworkList(ctx, list, rt(uid))
		})
	}

	list := runtimeList(t, confDir)
	if n := len(list.Plugins); n != 2 || list.Plugins[1].Network.Type != "ambientd-cni" {
		t.Fatalf("runtime's chain has %d plugins, last %q", n, list.Plugins[n-1].Network.Type)
	}
	if err := chain(true, list, "u1"); err != nil {
		t.Fatalf("ADD through the installed chain: %v", err)
	}
	if adds, _ := ag.events(); len(adds) != 1 || adds[0].UID != "u1" || len(adds[0].IPs) != 1 {
		t.Fatalf("agent got %+v, want one ADD for u1 with its IP", adds)
	}
	if err := chain(false, list, "u1"); err != nil {
		t.Fatalf("DEL through the installed chain: %v", err)
	}

	// Uninstall: the runtime is back on the original .conf, without us.
	if err := inst.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(confDir, "10-node.conf")); string(b) != primary {
		t.Fatalf("original .conf not restored byte for byte:\n%s", b)
	}
	list = runtimeList(t, confDir)
	if err := chain(true, list, "u2"); err != nil {
		t.Fatalf("ADD after uninstall: %v", err)
	}
	if adds, _ := ag.events(); len(adds) != 1 {
		t.Fatalf("our plugin still called after uninstall: %+v", adds)
	}
	if err := chain(false, list, "u2"); err != nil {
		t.Fatalf("DEL after uninstall: %v", err)
	}
}
