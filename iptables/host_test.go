package iptables

import (
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// probeSets lists both probe sets of n as "ip=comment".
func probeSets(t *testing.T, n ns.NetNS) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := n.Do(func(ns.NetNS) error {
		h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
		if err != nil {
			return err
		}
		defer h.Close()
		for _, f := range []Family{IPv4, IPv6} {
			set, err := listSet(h, f)
			if err != nil {
				return err
			}
			for ip, c := range set {
				out[ip.String()] = c
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

func TestHostProbeRules(t *testing.T) {
	requireTools(t)
	for _, mode := range modes {
		t.Run(string(mode), func(t *testing.T) { testHostProbe(t, mode) })
	}
}

func testHostProbe(t *testing.T, mode Mode) {
	ctx := testCtx(t)
	m := newTestManager(t, mode, Config{IPv6: true})
	node, pod := newNS(t), newNS(t)
	vethPair(t, pod, node, []netip.Addr{podIP}, []netip.Addr{peerIP}) // the node is the pod's gateway
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", appPort), "app", false)
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", InboundPort), "ztunnel-inbound", false)
	if err := m.ApplyPod(ctx, pod, PodOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []Family{IPv4, IPv6} {
		nsRun(t, node, tool(f, mode, ""), "-w", "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-m", "comment", "--comment", "foreign", "-j", "ACCEPT")
	}
	inNode := func(what string, fn func() error) {
		t.Helper()
		if err := node.Do(func(ns.NetNS) error { return fn() }); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	probe := func() string {
		t.Helper()
		got, err := ask(node, "tcp", netip.AddrPortFrom(podIP, appPort), dialOpts{})
		if err != nil {
			t.Fatalf("probe from node: %v", err)
		}
		return normalizeOrigDst(got)
	}

	// Before the pod's IP is in the set, the node's connection is captured
	// like any other inbound connection.
	inNode("EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
	if got, want := probe(), "ztunnel-inbound|-|"+peerIP.String(); got != want {
		t.Fatalf("probe without set entry: got %q, want %q", got, want)
	}

	// In the set: SNATed to the probe address, which the pod lets through.
	inNode("AddProbeIPs", func() error {
		return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String(), "fd00::2"))
	})
	if got, want := probe(), "app|-|"+ProbeSNATv4.String(); got != want {
		t.Fatalf("probe with set entry: got %q, want %q", got, want)
	}

	// Ensure again and add again: same rules, same entries.
	saves := map[Family]string{}
	for _, f := range []Family{IPv4, IPv6} {
		saves[f] = saveText(t, node, f, mode)
		want := ours(BuildHostRules(m.Config()).RenderApply(f), BuildHostRules(m.Config()))
		if got := ours(saves[f], BuildHostRules(m.Config())); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s host rules: got %q, want golden %q", f, got, want)
		}
	}
	inNode("EnsureHostRules again", func() error { return m.EnsureHostRules(ctx) })
	inNode("AddProbeIPs again", func() error { return m.AddProbeIPs(ctx, "uid-a", addrs(podIP.String())) })
	for _, f := range []Family{IPv4, IPv6} {
		if got := saveText(t, node, f, mode); got != saves[f] {
			t.Fatalf("second EnsureHostRules changed %s rules:\n%s\nvs\n%s", f, saves[f], got)
		}
	}
	want := map[string]string{podIP.String(): "uid-a", "fd00::2": "uid-a"}
	if got := probeSets(t, node); !maps.Equal(got, want) {
		t.Fatalf("probe sets %v, want %v", got, want)
	}

	// Removal by another uid (the IP was reused) leaves the entry.
	inNode("RemoveProbeIPs other uid", func() error { return m.RemoveProbeIPs(ctx, "uid-b", addrs(podIP.String())) })
	if got := probeSets(t, node); !maps.Equal(got, want) {
		t.Fatalf("removal by another uid changed the sets: %v", got)
	}
	inNode("RemoveProbeIPs", func() error { return m.RemoveProbeIPs(ctx, "uid-a", addrs("fd00::2", "10.9.9.9")) })
	delete(want, "fd00::2")
	if got := probeSets(t, node); !maps.Equal(got, want) {
		t.Fatalf("after removal: %v, want %v", got, want)
	}

	// Prune by difference: stale gone, live kept, missing added, relabelled.
	inNode("AddProbeIPs stale", func() error { return m.AddProbeIPs(ctx, "uid-gone", addrs("10.1.1.1", "fd00::9")) })
	inNode("PruneProbeIPs", func() error {
		return m.PruneProbeIPs(ctx, map[string][]netip.Addr{
			"uid-a": addrs(podIP.String()),
			"uid-c": addrs("10.1.1.3", "fd00::3"),
			"uid-d": addrs("10.1.1.1"), // reused IP of a gone pod
		})
	})
	want = map[string]string{podIP.String(): "uid-a", "10.1.1.3": "uid-c", "fd00::3": "uid-c", "10.1.1.1": "uid-d"}
	if got := probeSets(t, node); !maps.Equal(got, want) {
		t.Fatalf("after prune: %v, want %v", got, want)
	}
	if got, want := probe(), "app|-|"+ProbeSNATv4.String(); got != want {
		t.Fatalf("probe after prune: got %q, want %q", got, want)
	}

	// Delete: ours gone, foreign rule stays; again is fine.
	for i := 0; i < 2; i++ {
		inNode("DeleteHostRules", func() error { return m.DeleteHostRules(ctx) })
		for _, f := range []Family{IPv4, IPv6} {
			s := saveText(t, node, f, mode)
			if strings.Contains(s, "ISTIO_") || !strings.Contains(s, "--comment foreign -j ACCEPT") {
				t.Fatalf("%s after DeleteHostRules:\n%s", f, s)
			}
		}
		if out := nsRun(t, node, "ipset", "list", "-n"); strings.Contains(out, "istio-inpod-probes") {
			t.Fatalf("ipsets left: %s", out)
		}
	}
}
