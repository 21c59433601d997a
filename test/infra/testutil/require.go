// Package testutil holds small helpers shared by the tests of every package.
package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// SkipEnv names the variable that lets a developer without root skip the
// root-only tests on purpose. It is never set in CI, so there a missing
// privilege or tool fails the run instead of hiding behind a skip.
const SkipEnv = "AMBIENTD_ALLOW_SKIP"

// RequireRoot fails the test unless it runs as root. With AMBIENTD_ALLOW_SKIP=1
// it skips instead, loudly naming why.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv(SkipEnv) == "1" {
		t.Skipf("needs root; skipped because %s=1", SkipEnv)
	}
	t.Fatalf("this test needs root (network namespaces, iptables); run as root or set %s=1 to skip it deliberately", SkipEnv)
}

// RequireBinary fails the test unless every named program is on PATH, and
// returns their resolved paths in order. `make deps` installs them.
func RequireBinary(t testing.TB, names ...string) []string {
	t.Helper()
	paths := make([]string, 0, len(names))
	for _, n := range names {
		p, err := exec.LookPath(n)
		if err != nil {
			if os.Getenv(SkipEnv) == "1" {
				t.Skipf("needs %s; skipped because %s=1", n, SkipEnv)
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
