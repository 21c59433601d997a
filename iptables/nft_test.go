package iptables

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

func requireNFT(t testing.TB) {
	t.Helper()
	testutil.RequireIptables(t)
	testutil.RequireBinary(t, "nft")
}

var counterRE = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// nftList runs `nft list table inet <name>` for each table in n (counters
// zeroed); a missing table lists as "".
func nftList(t testing.TB, n ns.NetNS, tables ...string) string {
	t.Helper()
	var b strings.Builder
	for _, tb := range tables {
		out, err := nsRunErr(n, "nft", "list", "table", "inet", tb)
		if err != nil {
			if strings.Contains(err.Error(), "No such file or directory") {
				continue
			}
			t.Fatal(err)
		}
		b.WriteString(counterRE.ReplaceAllString(out, "counter packets 0 bytes 0"))
	}
	return b.String()
}

// nftHandles lists our rules with their handles (`nft -a`), to show a second
// apply rewrote nothing.
func nftHandles(t testing.TB, n ns.NetNS) string {
	t.Helper()
	return counterRE.ReplaceAllString(nsRun(t, n, "nft", "-a", "list", "ruleset"), "")
}

// ruleHandle finds the handle of the rule of table/chain whose text contains
// substr, from `nft -a list chain`.
func ruleHandle(t testing.TB, n ns.NetNS, table, chain, substr string) string {
	t.Helper()
	out := nsRun(t, n, "nft", "-a", "list", "chain", "inet", table, chain)
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, substr) {
			if _, h, ok := strings.Cut(l, "# handle "); ok {
				return strings.TrimSpace(h)
			}
		}
	}
	t.Fatalf("no rule with %q in %s %s:\n%s", substr, table, chain, out)
	return ""
}

func TestNFTPodRulesInNetns(t *testing.T) {
	requireNFT(t)
	for _, c := range goldenPodCases() {
		t.Run(c.name, func(t *testing.T) { testNFTPodRules(t, c) })
	}
}

func testNFTPodRules(t *testing.T, c goldenCase) {
	ctx := testCtx(t)
	m := newTestManager(t, ModeNFTables, c.cfg)
	pod := newNS(t)
	// Someone else's nftables table and iptables-nft rule, before and after.
	foreign := func(tag string) {
		nsRun(t, pod, "nft", "add", "table", "inet", "foreign-"+tag)
		nsRun(t, pod, "nft", "add", "chain", "inet", "foreign-"+tag, "out", "{ type filter hook output priority 0; }")
		nsRun(t, pod, "nft", "add", "rule", "inet", "foreign-"+tag, "out", "udp", "dport", "9999", "accept")
		addForeign(t, pod, IPv4, ModeNFT, tag)
	}
	foreignPresent := func(stage string) {
		t.Helper()
		for _, tag := range []string{"before", "after"} {
			if out := nftList(t, pod, "foreign-"+tag); !strings.Contains(out, "udp dport 9999 accept") {
				t.Fatalf("%s: foreign nft table %s gone:\n%s", stage, tag, out)
			}
			if s := saveText(t, pod, IPv4, ModeNFT); !foreignPresentSave(s, tag) {
				t.Fatalf("%s: foreign iptables-nft rules gone:\n%s", stage, s)
			}
		}
	}
	foreign("before")

	if err := m.ApplyPod(ctx, pod, c.opts); err != nil {
		t.Fatalf("ApplyPod: %v", err)
	}
	foreign("after")

	// `nft list` shows exactly the golden text: the expressions we program
	// mean what the golden file says.
	golden, err := os.ReadFile(filepath.Join("testdata", nftGoldenName(c)+".golden"))
	if err != nil {
		t.Fatal(err)
	}
	if got := nftList(t, pod, nftables.PodTables()...); got != string(golden) {
		t.Fatalf("nft list after apply differs from %s.golden:\n--- got\n%s\n--- want\n%s", nftGoldenName(c), got, golden)
	}
	foreignPresent("apply")
	if d, err := m.VerifyPod(ctx, pod, c.opts); err != nil || !d.Empty() {
		t.Fatalf("VerifyPod after apply: %v, %s", err, d)
	}

	// Apply again: nothing rewritten (same rule handles).
	before := nftHandles(t, pod)
	if err := m.ApplyPod(ctx, pod, c.opts); err != nil {
		t.Fatalf("second ApplyPod: %v", err)
	}
	if after := nftHandles(t, pod); after != before {
		t.Fatalf("second apply rewrote rules:\n%s\nvs\n%s", before, after)
	}

	// Drift behind our back: a rule deleted, a stray rule added, the ip rule gone.
	rs := BuildPodRulesNFT(c.cfg, c.opts)
	nat := rs.Tables[0]
	var last nftables.Rule // the first outbound redirect: nft -a finds that one
	for _, r := range nat.Rules {
		if r.Chain == nftables.ChainOutput && strings.Contains(r.Text(), "redirect to :15001") {
			last = r
			break
		}
	}
	nsRun(t, pod, "nft", "delete", "rule", "inet", nftables.TableNat, nftables.ChainOutput, "handle",
		ruleHandle(t, pod, nftables.TableNat, nftables.ChainOutput, "redirect to :15001"))
	nsRun(t, pod, "nft", "add", "rule", "inet", nftables.TableMangle, nftables.ChainPrerouting, "meta", "l4proto", "sctp", "accept")
	stray := ruleHandle(t, pod, nftables.TableMangle, nftables.ChainPrerouting, "sctp")
	nsRun(t, pod, "ip", "rule", "del", "fwmark", "0x111/0xfff", "lookup", "100")
	// VerifyPod names exactly that; apply repairs it.
	checkDriftRepaired(t, m, pod, c.opts,
		[]string{"ip rule pref 32764 fwmark 0x111/0xfff lookup 100", "nft inet istio-ambient-nat istio-output: " + last.Text()},
		[]string{"nft inet istio-ambient-mangle istio-prerouting: rule handle " + stray})
	if got := nftList(t, pod, nftables.PodTables()...); got != string(golden) {
		t.Fatalf("nft list after repair differs from golden:\n%s", got)
	}

	// Delete: nothing of ours left, foreign rules untouched; again is fine.
	for i := 0; i < 2; i++ {
		if err := m.DeletePod(ctx, pod); err != nil {
			t.Fatalf("DeletePod #%d: %v", i+1, err)
		}
		if out := nftList(t, pod, nftables.PodTables()...); out != "" {
			t.Fatalf("tables of ours left after delete:\n%s", out)
		}
		foreignPresent("delete")
		if rules := nsRun(t, pod, "ip", "rule"); strings.Contains(rules, "0x111") {
			t.Fatalf("policy route left after delete:\n%s", rules)
		}
	}
	d, err := m.VerifyPod(ctx, pod, c.opts)
	if err != nil || d.Empty() || len(d.Unexpected) != 0 {
		t.Fatalf("VerifyPod after delete should report everything missing, nothing unexpected: %v %s", err, d)
	}
}

func foreignPresentSave(save, tag string) bool { return foreignPresent(save, tag) }
