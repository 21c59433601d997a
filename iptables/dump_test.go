package iptables

import (
	"strings"
	"testing"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestDumpPod: the live-rules dump of a pod shows the rules ApplyPod put
// there, in every backend, from inside the pod's netns only.
func TestDumpPod(t *testing.T) {
	testutil.RequireIptables(t)
	testutil.RequireBinary(t, "nft")
	for _, tt := range []struct {
		mode Mode
		want []string
	}{
		{ModeLegacy, []string{"iptables-legacy-save", "*nat", "ISTIO_OUTPUT", "ISTIO_PRERT"}},
		{ModeNFT, []string{"iptables-nft-save", "*nat", "ISTIO_OUTPUT", "ISTIO_PRERT"}},
		{ModeNFTables, []string{"# nft list ruleset", "table", "istio"}},
	} {
		t.Run(string(tt.mode), func(t *testing.T) {
			ctx := testCtx(t)
			m := newTestManager(t, tt.mode, Config{})
			pod, empty := newNS(t), newNS(t)
			if err := m.ApplyPod(ctx, pod, PodOptions{}); err != nil {
				t.Fatal(err)
			}
			got, err := m.DumpPod(ctx, pod)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("dump lacks %q:\n%s", w, got)
				}
			}
			other, err := m.DumpPod(ctx, empty)
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(other, "ISTIO_") || strings.Contains(strings.ToLower(other), "istio") {
				t.Errorf("dump of another netns shows our rules:\n%s", other)
			}
		})
	}
}
