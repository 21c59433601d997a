package iptables

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables/internal/xtables"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

var modes = []Mode{ModeLegacy, ModeNFT}

// allModes adds the native nftables backend to the iptables variants.
var allModes = []Mode{ModeLegacy, ModeNFT, ModeNFTables}

func testCtx(t testing.TB) context.Context { return testutil.Context(t, 2*time.Minute) }

// newNS makes a throwaway network namespace with lo up, removed at cleanup.
func newNS(t testing.TB) ns.NetNS {
	t.Helper()
	return testutil.NewNetNS(t).NS
}

func newTestManager(t testing.TB, mode Mode, cfg Config) *Manager {
	t.Helper()
	cfg.Mode = mode
	m, err := NewManager(testCtx(t), cfg, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		t.Fatalf("NewManager(%s): %v", mode, err)
	}
	if m.Mode() != mode {
		t.Fatalf("Mode() = %s, want %s", m.Mode(), mode)
	}
	return m
}

// nsRun runs a program inside n and returns its stdout; failure fails the test.
func nsRun(t testing.TB, n ns.NetNS, name string, args ...string) string {
	t.Helper()
	out, err := nsRunErr(n, name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func nsRunErr(n ns.NetNS, name string, args ...string) (string, error) {
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var err error
		out, err = exec.CommandContext(ctx, name, args...).Output()
		if err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, ee.Stderr)
			}
			return fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
		}
		return nil
	})
	return string(out), err
}

func tool(f Family, mode Mode, what string) string {
	if what == "" {
		return fmt.Sprintf("%s-%s", f, mode)
	}
	return fmt.Sprintf("%s-%s-%s", f, mode, what)
}

// saveText runs the variant's save in n and drops comment lines and counters
// so two dumps of the same rules compare equal.
func saveText(t testing.TB, n ns.NetNS, f Family, mode Mode) string {
	t.Helper()
	out := nsRun(t, n, tool(f, mode, "save"))
	var keep []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "#") || l == "" {
			continue
		}
		keep = append(keep, l)
	}
	return strings.Join(keep, "\n")
}

// ours extracts the rules of the set's chains and the rules anywhere that
// jump into them, keyed "table/chain", in order. It reads both iptables-save
// output and our restore batches, so the two can be compared.
func ours(text string, rs RuleSet) map[string][]string {
	out := map[string][]string{}
	table := ""
	for _, l := range strings.Split(text, "\n") {
		switch {
		case strings.HasPrefix(l, "*"):
			table = l[1:]
		case strings.HasPrefix(l, "-A ") || strings.HasPrefix(l, "-I "):
			chain, args, _ := strings.Cut(l[3:], " ")
			if l[1] == 'I' {
				args = strings.TrimPrefix(args, "1 ")
			}
			target, _ := xtables.JumpTarget(args)
			if slices.Contains(rs.Chains(table), chain) || slices.Contains(rs.Chains(table), target) {
				out[table+"/"+chain] = append(out[table+"/"+chain], args)
			}
		}
	}
	return out
}

// checkDriftRepaired asserts VerifyPod names exactly the given drift, that
// ApplyPod repairs it, and that verifying against other options then finds
// drift.
func checkDriftRepaired(t *testing.T, m *Manager, pod ns.NetNS, opts PodOptions, wantMissing, wantUnexpected []string) {
	t.Helper()
	ctx := testCtx(t)
	d, err := m.VerifyPod(ctx, pod, opts)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.Missing, wantMissing) || !slices.Equal(d.Unexpected, wantUnexpected) {
		t.Fatalf("VerifyPod drift:\n%s\nwant missing %q\nwant unexpected %q", d, wantMissing, wantUnexpected)
	}
	if err := m.ApplyPod(ctx, pod, opts); err != nil {
		t.Fatalf("repairing ApplyPod: %v", err)
	}
	if d, err := m.VerifyPod(ctx, pod, opts); err != nil || !d.Empty() {
		t.Fatalf("VerifyPod after repair: %v, %s", err, d)
	}
	// Verify with other options reports the difference.
	other := opts
	other.DNSCapture = !other.DNSCapture
	if d, err := m.VerifyPod(ctx, pod, other); err != nil || d.Empty() {
		t.Fatalf("VerifyPod with DNS capture flipped found no drift (err %v)", err)
	}
}
