package multusemu

import (
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestRestartingRunsANewLifeAfterAFailure: a life that fails (no master
// yet: the entrypoint exits) is reported and followed by a new one, which
// writes Multus's file once a master exists; the end of ctx ends it all and
// takes Multus's file away, as a last exit does.
func TestRestartingRunsANewLifeAfterAFailure(t *testing.T) {
	dir := t.TempDir()
	var exits atomic.Int32
	stop := testutil.Run(t, Restarting(func() *Thin {
		return &Thin{Dir: dir, Interval: 10 * time.Millisecond}
	}, 10*time.Millisecond, func(err error) {
		if !strings.Contains(err.Error(), "cannot find valid master CNI config") {
			t.Errorf("exit: %v, want no master", err)
		}
		exits.Add(1)
	}))
	testutil.WaitFor(t, "a failed life reported", func() bool { return exits.Load() > 0 })

	master := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"}]}`
	if err := os.WriteFile(filepath.Join(dir, "10-calico.conflist"), []byte(master), 0o644); err != nil {
		t.Fatal(err)
	}
	multus := filepath.Join(dir, "00-multus.conflist")
	testutil.WaitFor(t, "a new life wrote Multus's file", func() bool {
		data, err := os.ReadFile(multus)
		return err == nil && strings.Contains(string(data), `"calico"`)
	})
	stop()
	if _, err := os.Stat(multus); !os.IsNotExist(err) {
		t.Errorf("Multus's file after the last exit: %v, want removed", err)
	}
}
