//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// nativeNFTBackend runs the agent with the native nftables backend (what
// auto picks on a clean node; the other e2e tests pin iptables-nft). A flag,
// as it must override DefaultAgentArgs' --iptables=nft.
const nativeNFTBackend = "--iptables=nftables"

// podNFT runs nft with args inside the pod's netns.
func podNFT(t *testing.T, p *e2eenv.Pod, args ...string) string {
	t.Helper()
	var buf bytes.Buffer
	err := p.Do(func() error {
		cmd := exec.Command("nft", args...)
		cmd.Stdout, cmd.Stderr = &buf, &buf
		return cmd.Run()
	})
	if err != nil {
		t.Fatalf("nft %s in pod %s: %v: %s", strings.Join(args, " "), p.Name, err, buf.String())
	}
	return buf.String()
}

// istioTables lists the istio-ambient-* tables in the pod's netns.
func istioTables(t *testing.T, p *e2eenv.Pod) []string {
	t.Helper()
	var out []string
	for _, l := range strings.Split(podNFT(t, p, "list", "tables"), "\n") {
		if f := strings.Fields(l); len(f) == 3 && strings.HasPrefix(f[2], "istio-ambient-") {
			out = append(out, f[1]+" "+f[2])
		}
	}
	slices.Sort(out) // listed in creation order; a repaired table comes last
	return out
}

// TestNativeNFTablesEndToEnd: with --iptables=nftables a new ambient pod is
// enrolled with Istio's native tables in its netns, its outbound TCP lands
// on ztunnel's 15001 with the original destination and inbound TCP on
// 15006; a deleted nat table is put back by the drift pass (counted); the
// pod's removal from the mesh leaves no istio-ambient table behind.
func TestNativeNFTablesEndToEnd(t *testing.T) {
	testutil.RequireBinary(t, "nft")
	s := newScenario(t, "nftnat", agentArgs(nativeNFTBackend), agentEnv("AMBIENTD_VERIFY_INTERVAL=1s"))
	ctx, nsName, em, a := s.ctx, s.ns, s.em, s.agent
	plainNS := uniqueNS("nftplain")
	createNamespace(t, ctx, plainNS, false)
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: nsName, Name: "nftpod"})
	client := createPod(t, ctx, e2eenv.PodSpec{Namespace: plainNS, Name: "client"})
	waitAnnotation(t, ctx, p, "enabled")

	want := []string{"inet " + iptables.NFTTableMangle, "inet " + iptables.NFTTableNat, "inet " + iptables.NFTTableRaw}
	if got := istioTables(t, p); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("pod tables %q, want %q", got, want)
	}
	if r := podRules(t, p); r != "" {
		t.Errorf("native nftables backend left iptables rules in the pod:\n%s", r)
	}
	nat := podNFT(t, p, "list", "table", "inet", iptables.NFTTableNat)
	if !strings.Contains(nat, "redirect to :15001") {
		t.Errorf("pod nat table has no redirect to 15001:\n%s", nat)
	}

	requireCaptured(t, ctx, em, p, outsideAddr())
	requireInbound(t, ctx, em, client, p)

	// Drift: the nat table deleted while the agent runs comes back.
	before := metricValue(t, ctx, a, "ambientd_repairs_total", `what="pod_rules"`)
	podNFT(t, p, "delete", "table", "inet", iptables.NFTTableNat)
	testutil.Until(t, ctx, "drift pass restoring the pod's nat table", func() bool {
		return strings.Join(istioTables(t, p), ",") == strings.Join(want, ",")
	})
	testutil.Until(t, ctx, "repair counted", func() bool {
		return metricValue(t, ctx, a, "ambientd_repairs_total", `what="pod_rules"`) >= before+1
	})
	if got := podNFT(t, p, "list", "table", "inet", iptables.NFTTableNat); !strings.Contains(got, "redirect to :15001") {
		t.Errorf("repaired nat table has no redirect to 15001:\n%s", got)
	}
	requireCaptured(t, ctx, em, p, outsideAddr())

	// Removal: label none takes the pod out and its tables with it.
	setPodMode(t, ctx, p, "none")
	waitNoAnnotation(t, ctx, p)
	testutil.Until(t, ctx, "no istio-ambient table left in the pod", func() bool { return len(istioTables(t, p)) == 0 })
}

// requireInbound dials the pod's IP from client (a pod out of the mesh on
// the same bridge) and waits until em accepted it on 15006.
func requireInbound(t *testing.T, ctx context.Context, em *e2eenv.Emulator, client, p *e2eenv.Pod) {
	t.Helper()
	count := func(s ztunnelemu.State) int {
		n := 0
		for _, r := range s.Accepted {
			if r.UID == p.UID && r.Port == 15006 {
				n++
			}
		}
		return n
	}
	before := count(emuState(t, ctx, em))
	dst := netip.AddrPortFrom(p.IP(), 8080).String()
	dialOnce(t, ctx, client, dst)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	waitEmu(t, wctx, em, "inbound connection to pod "+p.Name+" on 15006", func(s ztunnelemu.State) bool { return count(s) > before })
}
