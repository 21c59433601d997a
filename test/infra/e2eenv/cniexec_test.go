package e2eenv

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/build"
)

// TestChainExecDurations: every plugin process libcni runs through a chain is
// timed under its type and command, and only there.
func TestChainExecDurations(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Built here when missing: `make test` may run before anything else
	// built them (a fresh clone).
	var buildLog bytes.Buffer
	bins, err := build.Ensure(ctx, []build.Part{build.CNIPlugins}, build.Options{Log: &buildLog})
	if err != nil {
		t.Fatalf("%v\n%s", err, buildLog.String())
	}
	ref := bins.CNIRefDir
	dir := t.TempDir()
	c, err := NewChain(ChainConfig{BinDirs: []string{ref}, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
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
