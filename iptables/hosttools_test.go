package iptables

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// runTool runs a program inside n and returns its exit error, stdout and
// stderr (a tool that only warns still exits 0).
func runTool(n ns.NetNS, name string, args ...string) (stdout, stderr string, err error) {
	var o, e bytes.Buffer
	derr := n.Do(func(ns.NetNS) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Stdout, cmd.Stderr = &o, &e
		err = cmd.Run()
		return nil
	})
	if derr != nil {
		err = derr
	}
	return o.String(), e.String(), err
}

// TestHostToolsReadOurWrites: the node's own tools — this machine's nft and
// iptables-nft-save, the ones an operator or another agent on the node runs —
// read back everything we write over netlink, in a pod's netns (in-pod
// rules, with every option that adds rules or set elements) and in the
// node's (host probe SNAT, probe sets with a uid per element): they exit 0,
// print no warning and show our tables. Table, chain, rule and set-element
// metadata written by a newer libnftnl once made older `nft` binaries crash
// listing the ruleset (istio/istio#58492, projectcalico/calico#12654); we
// write that metadata ourselves, so this pins that the host's `nft` parses it.
// (In the iptables-nft mode iptables-nft-restore writes the rules; `nft`
// then only warns that it cannot print xtables targets, as for any
// iptables-nft rule.)
func TestHostToolsReadOurWrites(t *testing.T) {
	requireNFT(t)
	testutil.RequireBinary(t, "iptables-nft-save", "ip6tables-nft-save")
	for _, mode := range []Mode{ModeNFTables, ModeNFT} {
		t.Run(string(mode), func(t *testing.T) {
			ctx := testCtx(t)
			m := newTestManager(t, mode, Config{IPv6: true, KubeletUID: uidPtr(0)})
			node, pod := newNS(t), newNS(t)
			opts := PodOptions{DNSCapture: true, RerouteInterfaces: "tap0,net1"}
			if err := m.ApplyPod(ctx, pod, opts); err != nil {
				t.Fatalf("ApplyPod: %v", err)
			}
			inNode(t, node, "EnsureHostRules", func() error { return m.EnsureHostRules(ctx) })
			inNode(t, node, "AddProbeIPs", func() error {
				return m.AddProbeIPs(ctx, "0f8e9d2c-1b3a-4c5d-8e7f-9a0b1c2d3e4f", addrs("10.244.0.7", "fd00::7"))
			})
			for _, c := range []struct {
				where string
				n     ns.NetNS
				want  map[string][]string // tool → what its output must show
			}{
				{"pod", pod, map[string][]string{
					"nft":                {map[Mode]string{ModeNFTables: "table inet istio-ambient-nat", ModeNFT: "chain ISTIO_OUTPUT"}[mode], "15001"},
					"iptables-nft-save":  {map[Mode]string{ModeNFTables: "", ModeNFT: "-A ISTIO_OUTPUT"}[mode]},
					"ip6tables-nft-save": {map[Mode]string{ModeNFTables: "", ModeNFT: "-A ISTIO_OUTPUT"}[mode]},
				}},
				// In the iptables-nft mode the SNAT target is an xtables
				// target: `nft` prints it only when libxtables can
				// translate the revision iptables-nft chose (once seen
				// printed empty under a parallel run), so its address is
				// read where that mode's own tool shows it.
				{"node", node, map[string][]string{
					"nft":                {map[Mode]string{ModeNFTables: "istio-inpod-probes-v4", ModeNFT: "ISTIO_POSTRT"}[mode], map[Mode]string{ModeNFTables: "10.244.0.7", ModeNFT: "POSTROUTING"}[mode]},
					"iptables-nft-save":  {map[Mode]string{ModeNFTables: "", ModeNFT: "-A ISTIO_POSTRT"}[mode], map[Mode]string{ModeNFTables: "", ModeNFT: "169.254.7.127"}[mode]},
					"ip6tables-nft-save": {map[Mode]string{ModeNFTables: "", ModeNFT: "-A ISTIO_POSTRT"}[mode], map[Mode]string{ModeNFTables: "", ModeNFT: "fd16:9254:7127:1337"}[mode]},
				}},
			} {
				for _, args := range [][]string{{"nft", "list", "ruleset"}, {"nft", "-a", "list", "ruleset"}, {"nft", "-j", "list", "ruleset"}, {"iptables-nft-save"}, {"ip6tables-nft-save"}} {
					out, stderr, err := runTool(c.n, args[0], args[1:]...)
					if err != nil || unexpectedStderr(mode, stderr) != "" {
						t.Errorf("%s netns: %s: %v, stderr %q", c.where, strings.Join(args, " "), err, stderr)
						continue
					}
					if len(args) > 1 && args[1] == "-j" {
						continue // JSON: parsed without error is the point
					}
					for _, w := range c.want[args[0]] {
						if !strings.Contains(out, w) {
							t.Errorf("%s netns: %s does not show %q:\n%s", c.where, strings.Join(args, " "), w, out)
						}
					}
				}
			}
		})
	}
}

// unexpectedStderr returns the lines of stderr a tool should not print
// after our writes: none after the native nftables backend's; after
// iptables-nft's, only nft's notes about iptables-nft's tables and the
// xtables matches and targets it cannot print.
func unexpectedStderr(mode Mode, stderr string) string {
	var bad []string
	for _, l := range strings.Split(strings.TrimSpace(stderr), "\n") {
		switch {
		case l == "":
		case mode == ModeNFT && (strings.HasPrefix(l, "# Warning: table ") && strings.HasSuffix(l, " is managed by iptables-nft, do not touch!") ||
			strings.HasPrefix(l, "XT target ") && strings.HasSuffix(l, " not found") ||
			strings.HasPrefix(l, "Warning: Extension ") && strings.HasSuffix(l, " is not supported, missing kernel module?")):
		default:
			bad = append(bad, l)
		}
	}
	return strings.Join(bad, "\n")
}
