package nftables

import (
	"context"
	"log/slog"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/rules"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// inPod runs fn in a fresh network namespace (lo up) on a locked thread.
func inPod(t *testing.T, pod ns.NetNS, fn func() error) {
	t.Helper()
	if err := pod.Do(func(ns.NetNS) error { return fn() }); err != nil {
		t.Fatal(err)
	}
}

var counterRE = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// handles lists the namespace's rules with their handles (`nft -a`,
// counters dropped): equal listings mean nothing was rewritten.
func handles(t *testing.T, pod ns.NetNS) string {
	t.Helper()
	var out []byte
	inPod(t, pod, func() error {
		var err error
		out, err = exec.Command("nft", "-a", "list", "ruleset").Output()
		return err
	})
	return counterRE.ReplaceAllString(string(out), "")
}

// TestNFTFailedTransactionChangesNothing: a transaction the kernel rejects
// (here a rule jumping to a chain that does not exist, appended to a valid
// rule set) leaves the pod's rules exactly as they were — the repair of a
// drifted pod is all or nothing.
func TestNFTFailedTransactionChangesNothing(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "nft")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var bg sync.WaitGroup
	defer bg.Wait()
	n := rules.Node{IPv6: true}
	pod := testutil.NewNetNS(t).NS
	var b *Backend
	inPod(t, pod, func() error {
		var err error
		if b, err = New(ctx, Config{Node: n, KubeletUID: new(uint32)}, slog.New(slog.DiscardHandler), &bg, true); err != nil {
			return err
		}
		return b.ApplyPod(ctx, rules.PodOptions{}, nil)
	})
	before := handles(t, pod)
	broken := BuildPodRules(n, rules.PodOptions{DNSCapture: true}) // differs: a repair is attempted
	broken.Tables[0].Rules = append(broken.Tables[0].Rules, Rule{Chain: ChainOutput, stmts: []statement{jump("no-such-chain")}})
	err := pod.Do(func(ns.NetNS) error {
		c, done, err := b.open(nil)
		if err != nil {
			return err
		}
		defer done()
		_, err = b.converge(c, nil, broken)
		return err
	})
	if err == nil {
		t.Fatal("converge with a rule jumping nowhere succeeded")
	}
	// The error names the message the kernel refused.
	if want := "add rule istio-ambient-nat istio-output: jump no-such-chain"; !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not name the refused rule (%q)", err, want)
	}
	if after := handles(t, pod); after != before {
		t.Fatalf("failed transaction changed the rules:\n%s\nvs\n%s", before, after)
	}
	var d rules.Drift
	inPod(t, pod, func() error {
		var err error
		d, err = b.VerifyPod(ctx, rules.PodOptions{}, nil)
		return err
	})
	if !d.Empty() {
		t.Fatalf("VerifyPod after failed transaction: %s", d)
	}
}
