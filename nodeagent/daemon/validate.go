package daemon

import (
	"fmt"
	"net"
	"path/filepath"
	"time"

	"github.com/ambientd/ambientd/nodeagent/repair"
)

// Validate checks a Config as a node runs it, in a fixed order (so with
// several bad fields the same is reported every time): the process's own
// settings (sockets, listeners, the CNI conf dir), then Agent's
// (agent.Config.Validate), NodeReady's (its NodeName defaults to the
// agent's) and Sidecar's. Each error starts with the flag that sets the
// field (RegisterFlags) and the value.
func (c Config) Validate() error {
	bad := func(flag, format string, args ...any) error {
		return fmt.Errorf("--"+flag+" "+format, args...)
	}
	// A node names every socket (New's defaults for empty paths serve
	// tests) and the conf dir, all absolute: relative ones would depend on
	// the agent's working directory.
	for _, p := range []struct{ flag, path string }{{"ztunnel-socket", c.ZtunnelSocket}, {"cni-socket", c.CNISocket}, {"cni-conf-dir", c.CNIConfDir}, {"admin-socket", c.AdminSocket}} {
		if !filepath.IsAbs(p.path) {
			return bad(p.flag, "%q: must be an absolute path", p.path)
		}
	}
	if c.ZtunnelSocket == c.CNISocket || c.AdminSocket == c.CNISocket || c.AdminSocket == c.ZtunnelSocket {
		return bad("cni-socket", "%q: the ztunnel socket %q, the CNI socket and the admin socket %q must differ", c.CNISocket, c.ZtunnelSocket, c.AdminSocket)
	}
	for _, a := range []struct{ flag, addr string }{{"health-addr", c.HealthAddr}, {"metrics-addr", c.MetricsAddr}, {"pprof-addr", c.PprofAddr}} {
		if a.addr == "" && a.flag == "pprof-addr" {
			continue // off
		}
		if _, _, err := net.SplitHostPort(a.addr); err != nil {
			return bad(a.flag, "%q: want host:port: %w", a.addr, err)
		}
	}
	// Below a second the probe is most of the connection's traffic;
	// above five minutes a hung ztunnel black-holes its pods that long.
	if d := c.ZtunnelProbeInterval; d != 0 && (d < time.Second || d > 5*time.Minute) {
		return bad("ztunnel-probe-interval", "%v: want 1s to 5m", d)
	}
	if err := c.Agent.Validate(); err != nil {
		return err
	}
	nr := c.NodeReady
	if nr.NodeName == "" {
		nr.NodeName = c.Agent.NodeName
	}
	if err := nr.Validate(); err != nil {
		return err
	}
	if c.Sidecar.Repair.Mode == repair.ModeLabel && c.Sidecar.Repair.LabelKey == "" {
		return bad("repair-label-key", "is empty: required by --repair-mode label")
	}
	return nil
}
