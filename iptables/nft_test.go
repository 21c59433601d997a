package iptables

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

func requireNFT(t testing.TB) {
	t.Helper()
	requireTools(t)
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
	if got := nftList(t, pod, podNFTTables...); got != string(golden) {
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
	var last NFTRule // the first outbound redirect: nft -a finds that one
	for _, r := range nat.Rules {
		if r.Chain == nftChainOutput && strings.Contains(r.Text(), "redirect to :15001") {
			last = r
			break
		}
	}
	nsRun(t, pod, "nft", "delete", "rule", "inet", NFTTableNat, nftChainOutput, "handle",
		ruleHandle(t, pod, NFTTableNat, nftChainOutput, "redirect to :15001"))
	nsRun(t, pod, "nft", "add", "rule", "inet", NFTTableMangle, nftChainPrerouting, "meta", "l4proto", "sctp", "accept")
	stray := ruleHandle(t, pod, NFTTableMangle, nftChainPrerouting, "sctp")
	nsRun(t, pod, "ip", "rule", "del", "fwmark", "0x111/0xfff", "lookup", "100")
	// VerifyPod names exactly that; apply repairs it.
	checkDriftRepaired(t, m, pod, c.opts,
		[]string{"ip rule pref 32764 fwmark 0x111/0xfff lookup 100", "nft inet istio-ambient-nat istio-output: " + last.Text()},
		[]string{"nft inet istio-ambient-mangle istio-prerouting: rule handle " + stray})
	if got := nftList(t, pod, podNFTTables...); got != string(golden) {
		t.Fatalf("nft list after repair differs from golden:\n%s", got)
	}

	// Delete: nothing of ours left, foreign rules untouched; again is fine.
	for i := 0; i < 2; i++ {
		if err := m.DeletePod(ctx, pod); err != nil {
			t.Fatalf("DeletePod #%d: %v", i+1, err)
		}
		if out := nftList(t, pod, podNFTTables...); out != "" {
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

// TestNFTFailedTransactionChangesNothing: a transaction the kernel rejects
// (here a rule jumping to a chain that does not exist, appended to a valid
// rule set) leaves the pod's rules exactly as they were — the repair of a
// drifted pod is all or nothing.
func TestNFTFailedTransactionChangesNothing(t *testing.T) {
	requireNFT(t)
	ctx := testCtx(t)
	cfg := Config{IPv6: true}
	m := newTestManager(t, ModeNFTables, cfg)
	pod := newNS(t)
	if err := m.ApplyPod(ctx, pod, PodOptions{}); err != nil {
		t.Fatal(err)
	}
	before := nftHandles(t, pod)
	broken := BuildPodRulesNFT(cfg, PodOptions{DNSCapture: true}) // differs: a repair is attempted
	broken.Tables[0].Rules = append(broken.Tables[0].Rules, NFTRule{Chain: nftChainOutput, stmts: []nftStmt{jump("no-such-chain")}})
	be := m.be.(*nftBackend)
	err := pod.Do(func(ns.NetNS) error {
		return be.with(func(c *nftables.Conn) error {
			_, err := be.converge(c, nil, broken)
			return err
		})
	})
	if err == nil {
		t.Fatal("converge with a rule jumping nowhere succeeded")
	}
	if after := nftHandles(t, pod); after != before {
		t.Fatalf("failed transaction changed the rules:\n%s\nvs\n%s", before, after)
	}
	if d, err := m.VerifyPod(ctx, pod, PodOptions{}); err != nil || !d.Empty() {
		t.Fatalf("VerifyPod after failed transaction: %v %s", err, d)
	}
}

// TestFindKubeletUID: the uid of kubelet (with "kubelet" in its command
// line), kubelite or k3s, from a /proc-like tree; 0 and an error when none.
func TestFindKubeletUID(t *testing.T) {
	proc := func(t *testing.T, procs map[string][3]string) string {
		dir := t.TempDir()
		for pid, p := range procs {
			d := filepath.Join(dir, pid)
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
			for name, content := range map[string]string{"comm": p[0] + "\n", "cmdline": p[1], "status": "Name:\t" + p[0] + "\nUid:\t" + p[2] + "\t" + p[2] + "\t" + p[2] + "\t" + p[2] + "\n"} {
				if err := os.WriteFile(filepath.Join(d, name), []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
		return dir
	}
	tests := []struct {
		name  string
		procs map[string][3]string
		want  uint32
		err   bool
	}{
		{"kubelet", map[string][3]string{"1": {"systemd", "/sbin/init", "0"}, "42": {"kubelet", "/usr/bin/kubelet\x00--config", "1001"}}, 1001, false},
		{"kubelet comm without kubelet in cmdline", map[string][3]string{"42": {"kubelet", "/opt/other", "7"}}, 0, true},
		{"k3s", map[string][3]string{"9": {"k3s", "/usr/local/bin/k3s\x00agent", "0"}}, 0, false},
		{"kubelite", map[string][3]string{"9": {"kubelite", "/snap/microk8s/kubelite\x00--kubelet-args-file", "5"}}, 5, false},
		{"none", map[string][3]string{"1": {"systemd", "/sbin/init", "0"}}, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := findKubeletUID(proc(t, tt.procs))
			if got != tt.want || (err != nil) != tt.err {
				t.Fatalf("findKubeletUID = %d, %v; want %d, error %v", got, err, tt.want, tt.err)
			}
		})
	}
	if _, err := findKubeletUID("/nonexistent-proc"); err == nil {
		t.Fatal("no error for a missing proc dir")
	}
}
