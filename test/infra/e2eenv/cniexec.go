package e2eenv

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
)

// timedExec is libcni's default plugin exec that also records how long each
// plugin process ran (exec to exit, output read), by plugin and command, so
// the benchmark can split a chain ADD into its plugins and libcni's own work.
type timedExec struct {
	invoke.DefaultExec
	mu    sync.Mutex
	times map[string][]time.Duration // "plugin CMD" → durations
}

func newTimedExec() *timedExec {
	return &timedExec{
		DefaultExec: invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}, PluginDecoder: version.PluginDecoder{}},
		times:       map[string][]time.Duration{},
	}
}

func (t *timedExec) ExecPlugin(ctx context.Context, path string, stdin []byte, environ []string) ([]byte, error) {
	cmd := ""
	for _, e := range environ {
		if v, ok := strings.CutPrefix(e, "CNI_COMMAND="); ok {
			cmd = v
		}
	}
	start := time.Now()
	out, err := t.DefaultExec.ExecPlugin(ctx, path, stdin, environ)
	d := time.Since(start)
	t.mu.Lock()
	k := filepath.Base(path) + " " + cmd
	t.times[k] = append(t.times[k], d)
	t.mu.Unlock()
	return out, err
}

// ExecDurations returns how long each exec of plugin (its type, e.g.
// "bridge") for command (e.g. "ADD") took through this chain so far:
// process start to exit as libcni sees it.
func (c *Chain) ExecDurations(plugin, command string) []time.Duration {
	c.exec.mu.Lock()
	defer c.exec.mu.Unlock()
	return append([]time.Duration(nil), c.exec.times[plugin+" "+command]...)
}
