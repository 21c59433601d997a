// Package testutil holds small helpers shared by the tests of every package.
package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// RequireRoot fails the test unless it runs as root. Under `go test -short`
// (make unit) it skips instead, naming why. CI never passes -short, so there
// a missing privilege fails the run instead of hiding behind a skip.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if testing.Short() {
		t.Skip("needs root; skipped under -short")
	}
	t.Fatal("this test needs root (network namespaces, iptables); run as root, or `go test -short` (make unit) to skip it deliberately")
}

// RequireBinary fails the test unless every named program is on PATH, and
// returns their resolved paths in order. `make deps` installs them.
func RequireBinary(t testing.TB, names ...string) []string {
	t.Helper()
	paths := make([]string, 0, len(names))
	for _, n := range names {
		p, err := exec.LookPath(n)
		if err != nil {
			if testing.Short() {
				t.Skipf("needs %s; skipped under -short", n)
			}
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
