package iptables

import (
	"strings"
	"testing"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
)

// TestNFTDeletedTableRepaired: a pod's nat table deleted behind our back
// (the drift a NET_ADMIN container or a sandbox reset causes) is reported
// missing by VerifyPod and put back by ApplyPod.
func TestNFTDeletedTableRepaired(t *testing.T) {
	requireNFT(t)
	ctx := testCtx(t)
	c := goldenPodCases()[0]
	m := newTestManager(t, ModeNFTables, c.cfg)
	pod := newNS(t)
	if err := m.ApplyPod(ctx, pod, c.opts); err != nil {
		t.Fatalf("ApplyPod: %v", err)
	}
	for _, table := range nftables.PodTables() {
		t.Run(table, func(t *testing.T) {
			nsRun(t, pod, "nft", "delete", "table", "inet", table)
			d, err := m.VerifyPod(ctx, pod, c.opts)
			if err != nil {
				t.Fatalf("VerifyPod: %v", err)
			}
			if !strings.Contains(d.String(), "nft add table inet "+table) {
				t.Fatalf("VerifyPod after deleting %s: drift %q, want it missing", table, d)
			}
			if err := m.ApplyPod(ctx, pod, c.opts); err != nil {
				t.Fatalf("ApplyPod: %v", err)
			}
			if d, err := m.VerifyPod(ctx, pod, c.opts); err != nil || !d.Empty() {
				t.Fatalf("VerifyPod after repair: %v, %s", err, d)
			}
			if out := nftList(t, pod, table); !strings.Contains(out, "table inet "+table) {
				t.Fatalf("table %s not back:\n%s", table, out)
			}
		})
	}
}
