// Package testutil holds small helpers shared by the tests of every package.
package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// EnvPrivileged opts in to the tests that need root or a built program
// (network namespaces, iptables, nftables, kube binaries): set to 1, they
// run, and a missing privilege or tool fails them; unset, they skip with a
// one-line reason, so `go test ./...` is green for any user. The make
// targets that run them (make test-root, e2e, e2e-node, soak, …) and CI
// set it.
const EnvPrivileged = "AMBIENTD_PRIVILEGED"

// EnvPrivilegedLog, when set, names a file to which every privileged test
// that ran appends its name: `make test-root` counts them and fails when
// fewer ran than it expects, so a suite that silently stopped running
// (skipped, or no longer asking) is caught.
const EnvPrivilegedLog = "AMBIENTD_PRIVILEGED_LOG"

// Privileged reports whether the privileged tests were asked for.
func Privileged() bool { return os.Getenv(EnvPrivileged) == "1" }

// requirePrivileged skips t unless privileged tests were asked for, naming
// what it needs, and records that it runs.
func requirePrivileged(t testing.TB, needs string) {
	t.Helper()
	if !Privileged() {
		t.Skipf("needs %s: set %s=1 to run it (make test-root does)", needs, EnvPrivileged)
	}
	if path := os.Getenv(EnvPrivilegedLog); path != "" {
		if f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644); err == nil {
			fmt.Fprintln(f, t.Name())
			f.Close()
		}
	}
}

// RequireRoot runs the test only when privileged tests were asked for
// (AMBIENTD_PRIVILEGED=1), and then fails it unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	requirePrivileged(t, "root (network namespaces, iptables)")
	if os.Geteuid() != 0 {
		t.Fatalf("this test needs root (network namespaces, iptables) and %s=1 asks for it: run as root", EnvPrivileged)
	}
}

// RequireBinary runs the test only when privileged tests were asked for,
// and then fails it unless every named program is on PATH; it returns
// their resolved paths in order. `make deps` installs them.
func RequireBinary(t testing.TB, names ...string) []string {
	t.Helper()
	requirePrivileged(t, fmt.Sprintf("the programs %v", names))
	paths := make([]string, 0, len(names))
	for _, n := range names {
		p, err := exec.LookPath(n)
		if err != nil {
			t.Fatalf("this test needs %q on PATH (run `make deps`): %v", n, err)
		}
		paths = append(paths, p)
	}
	return paths
}

// RequireIptables fails the test unless it runs as root with both iptables
// variants (legacy and nft, IPv4 and IPv6, save and restore) on PATH, plus
// any extra programs named.
func RequireIptables(t testing.TB, extra ...string) {
	t.Helper()
	RequireRoot(t)
	RequireBinary(t, append([]string{
		"iptables-legacy-save", "iptables-legacy-restore", "iptables-nft-save", "iptables-nft-restore",
		"ip6tables-legacy-save", "ip6tables-legacy-restore", "ip6tables-nft-save", "ip6tables-nft-restore",
	}, extra...)...)
}
