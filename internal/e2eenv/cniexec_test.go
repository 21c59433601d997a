package e2eenv

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/ambientd/ambientd/internal/testutil"
)

// TestChainExecDurations: every plugin process libcni runs through a chain is
// timed under its type and command, and only there.
func TestChainExecDurations(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	ref, err := cniRefDir(root)
	if err != nil {
		t.Fatal(err)
	}
	testutil.RequireBinary(t, filepath.Join(ref, "loopback"))
	dir := t.TempDir()
	c, err := NewChain(ChainConfig{BinDirs: []string{ref}, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range 2 {
		if _, err := c.cni.GetVersionInfo(ctx, "loopback"); err != nil {
			t.Fatalf("loopback VERSION: %v", err)
		}
	}
	got := c.ExecDurations("loopback", "VERSION")
	if len(got) != 2 {
		t.Fatalf("loopback VERSION execs timed: %d, want 2", len(got))
	}
	for _, d := range got {
		if d <= 0 {
			t.Errorf("exec duration %v, want > 0", d)
		}
	}
	if n := len(c.ExecDurations("loopback", "ADD")) + len(c.ExecDurations("bridge", "VERSION")); n != 0 {
		t.Errorf("%d execs timed under a plugin/command that never ran", n)
	}
}
