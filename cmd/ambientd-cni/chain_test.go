package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/ambientd/ambientd/nodeagent/agent"
)

// recordingExec execs plugins for real (libcni's own RawExec) and keeps each
// one's stdout, so the test can compare the bridge's result with the chain's.
type recordingExec struct {
	invoke.RawExec
	version.PluginDecoder
	mu  sync.Mutex
	out map[string][]byte // plugin name -> last stdout
}

func (e *recordingExec) ExecPlugin(ctx context.Context, pluginPath string, stdin []byte, environ []string) ([]byte, error) {
	out, err := e.RawExec.ExecPlugin(ctx, pluginPath, stdin, environ)
	e.mu.Lock()
	e.out[filepath.Base(pluginPath)] = out
	e.mu.Unlock()
	return out, err
}

func (e *recordingExec) stdout(plugin string) []byte {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.out[plugin]
}

// TestChain runs the real chain — loopback, bridge with host-local, then
// ambientd-cni — through libcni, the way a container runtime does, against a
// real agent socket. The "host" side of the chain is a throwaway netns too, so
// the bridge never lands in the machine's root namespace.
func TestChain(t *testing.T) {
	for _, v := range []string{"0.4.0", "1.0.0", "1.1.0"} {
		t.Run("cniVersion="+v, func(t *testing.T) { testChain(t, v) })
	}
}

func testChain(t *testing.T, cniVersion string) {
	hostNS := newNS(t)
	podNS := newNS(t)
	ag := &fakeAgent{outcome: agent.Enrolled}
	sock := startAgent(t, ag)
	ipamDir := t.TempDir()
	logFile := filepath.Join(t.TempDir(), "log", "ambientd-cni.log")

	confList := fmt.Sprintf(`{
  "cniVersion": %q,
  "name": "ambient-test",
  "plugins": [
    {"type": "loopback"},
    {"type": "bridge", "bridge": "amb-test0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "dataDir": %q,
              "ranges": [[{"subnet": "10.88.7.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "ambientd-cni", "agentSocket": %q, "timeout": "30s", "logLevel": "debug", "logFile": %q}
  ]
}`, cniVersion, ipamDir, sock, logFile)
	list, err := libcni.ConfListFromBytes([]byte(confList))
	if err != nil {
		t.Fatalf("parse conflist: %v", err)
	}
	rec := &recordingExec{RawExec: invoke.RawExec{Stderr: os.Stderr}, out: map[string][]byte{}}
	cni := libcni.NewCNIConfigWithCacheDir([]string{binDir}, t.TempDir(), rec)
	rt := &libcni.RuntimeConf{
		ContainerID: "infra-0123456789",
		NetNS:       podNS.Path(),
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", "shop"},
			{"K8S_POD_NAME", "web-0"},
			{"K8S_POD_INFRA_CONTAINER_ID", "infra-0123456789"},
			{"K8S_POD_UID", "0b5a3f6e-7d1c-4c59-9d0e-5f1f5a2c7e11"},
		},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// libcni execs the plugins from the calling thread, so they inherit the
	// netns ns.Do locks that thread into.
	inHost := func(f func() error) error {
		return hostNS.Do(func(ns.NetNS) error { return f() })
	}

	// ADD.
	var res types.Result
	if err := inHost(func() (err error) {
		res, err = cni.AddNetworkList(ctx, list, rt)
		return err
	}); err != nil {
		t.Fatalf("ADD through the chain: %v", err)
	}

	// The chain's result is the bridge's, unchanged.
	bridgeOut, oursOut := rec.stdout("bridge"), rec.stdout("ambientd-cni")
	if len(bridgeOut) == 0 || len(oursOut) == 0 {
		t.Fatalf("missing plugin output: bridge %q, ambientd-cni %q", bridgeOut, oursOut)
	}
	finalJSON, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	if !sameJSON(t, bridgeOut, oursOut) || !sameJSON(t, bridgeOut, finalJSON) {
		t.Errorf("chain result differs from the bridge result:\nbridge: %s\nours:   %s\nfinal:  %s", bridgeOut, oursOut, finalJSON)
	}

	// The agent got the pod's identity, netns and the address host-local
	// assigned, which is really on the pod's eth0.
	cur, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	var podIPs []netip.Prefix
	for _, ip := range cur.IPs {
		if ip.Interface != nil && cur.Interfaces[*ip.Interface].Sandbox == podNS.Path() {
			p, _ := netip.AddrFromSlice(ip.Address.IP)
			ones, _ := ip.Address.Mask.Size()
			podIPs = append(podIPs, netip.PrefixFrom(p.Unmap(), ones))
		}
	}
	if len(podIPs) != 1 || !netip.MustParsePrefix("10.88.7.0/24").Contains(podIPs[0].Addr()) {
		t.Fatalf("bridge result pod IPs = %v, want one in 10.88.7.0/24", podIPs)
	}
	if got := eth0Addrs(t, podNS); !slices.Contains(got, podIPs[0]) {
		t.Errorf("pod eth0 has %v, want %v", got, podIPs[0])
	}
	adds, _ := ag.events()
	want := agent.PodEvent{
		Name: "web-0", Namespace: "shop", UID: "0b5a3f6e-7d1c-4c59-9d0e-5f1f5a2c7e11",
		InfraContainerID: "infra-0123456789", NetnsPath: podNS.Path(), IPs: podIPs, Interface: "eth0",
	}
	if len(adds) == 1 {
		// The binary's own steps travel with the call (measurements,
		// compared apart from the pod's identity).
		got := adds[0]
		if got.Plugin.Init <= 0 || got.Plugin.Config <= 0 || got.Plugin.CallStart.IsZero() || got.Plugin.CallStart.After(got.Received) {
			t.Errorf("plugin timings %+v received %v: want init and config measured, the call started before it was received", got.Plugin, got.Received)
		}
		adds[0].Plugin, adds[0].Received = agent.PodEvent{}.Plugin, time.Time{}
	}
	if len(adds) != 1 || !reflect.DeepEqual(adds[0], want) {
		t.Errorf("agent got adds %+v, want [%+v]", adds, want)
	}

	// CHECK runs through the whole chain.
	if err := inHost(func() error { return cni.CheckNetworkList(ctx, list, rt) }); err != nil {
		t.Errorf("CHECK through the chain: %v", err)
	}
	if cniVersion == "1.1.0" {
		if err := inHost(func() error { return cni.GetStatusNetworkList(ctx, list) }); err != nil {
			t.Errorf("STATUS through the chain: %v", err)
		}
	}

	// DEL tells the agent and releases the address.
	if err := inHost(func() error { return cni.DelNetworkList(ctx, list, rt) }); err != nil {
		t.Fatalf("DEL through the chain: %v", err)
	}
	_, dels := ag.events()
	if len(dels) != 1 || dels[0].UID != want.UID || dels[0].Name != "web-0" || !reflect.DeepEqual(dels[0].IPs, podIPs) {
		t.Errorf("agent got dels %+v, want one for web-0 with IPs %v", dels, podIPs)
	}
	if _, err := os.Stat(filepath.Join(ipamDir, "ambient-test", podIPs[0].Addr().String())); !os.IsNotExist(err) {
		t.Errorf("host-local still holds %v after DEL: %v", podIPs[0], err)
	}
	if cniVersion == "1.1.0" {
		if err := inHost(func() error { return cni.GCNetworkList(ctx, list, &libcni.GCArgs{}) }); err != nil {
			t.Errorf("GC through the chain: %v", err)
		}
	}

	// The plugin logged to its file, and never to stdout (which would have
	// broken the result comparisons above).
	if b, err := os.ReadFile(logFile); err != nil || len(b) == 0 {
		t.Errorf("plugin log file: %v, %d bytes", err, len(b))
	}
}

func sameJSON(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("bad JSON %q: %v", a, err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("bad JSON %q: %v", b, err)
	}
	return reflect.DeepEqual(x, y)
}

func eth0Addrs(t *testing.T, n ns.NetNS) []netip.Prefix {
	t.Helper()
	var out []netip.Prefix
	err := n.Do(func(ns.NetNS) error {
		link, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		addrs, err := netlink.AddrList(link, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			p, _ := netip.AddrFromSlice(a.IP)
			ones, _ := a.Mask.Size()
			out = append(out, netip.PrefixFrom(p.Unmap(), ones))
		}
		return nil
	})
	if err != nil {
		t.Fatalf("list pod eth0 addresses: %v", err)
	}
	return out
}

// TestConcurrentAdds: the runtime creates sandboxes in parallel; every ADD
// reaches the agent with its own identity.
func TestConcurrentAdds(t *testing.T) {
	podNS := newNS(t)
	ag := &fakeAgent{outcome: agent.Pending}
	sock := startAgent(t, ag)
	stdin := netconf("1.1.0", fmt.Sprintf(`,"agentSocket":%q`, sock), prevResult(podNS.Path()))
	const n = 16
	errs := make(chan error, n)
	for i := range n {
		go func() {
			// execPlugin may t.Fatal (Goexit): always report.
			err := fmt.Errorf("web-%d: plugin exec aborted", i)
			defer func() { errs <- err }()
			args := fmt.Sprintf("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-%d;K8S_POD_UID=uid-%d", i, i)
			r := execPlugin(t, cniEnv("ADD", podNS.Path(), args), stdin, nil)
			if r.exit != 0 {
				err = fmt.Errorf("web-%d: exit %d: %s", i, r.exit, r.stdout)
				return
			}
			err = nil
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	adds, _ := ag.events()
	seen := map[string]bool{}
	for _, ev := range adds {
		if ev.UID != "uid-"+strings.TrimPrefix(ev.Name, "web-") {
			t.Errorf("event mixes pods: %+v", ev)
		}
		seen[ev.Name] = true
	}
	if len(seen) != n || len(adds) != n {
		t.Errorf("agent saw %d adds for %d distinct pods, want %d", len(adds), len(seen), n)
	}
}
