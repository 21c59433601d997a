package daemon

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"time"

	"github.com/ambientd/ambientd/nodeagent/agent"
)

// Validate checks a Config as a node runs it: the process's own settings
// (sockets, listeners, the CNI conf dir), then Agent's (agent.Config.Validate, its fields reported as
// "Agent.<field>"); NodeReady and Sidecar validate themselves where they
// are built. Errors are *agent.SettingError (one type for the process's
// settings), checked in a fixed order, so with several bad fields the same
// is reported every time.
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return &agent.SettingError{Field: field, Err: fmt.Errorf(format, args...)}
	}
	// A node names every socket (New's defaults for empty paths serve
	// tests) and the conf dir, all absolute: relative ones would depend on
	// the agent's working directory.
	for _, p := range []struct{ field, path string }{{"ZtunnelSocket", c.ZtunnelSocket}, {"CNISocket", c.CNISocket}, {"CNIConfDir", c.CNIConfDir}, {"AdminSocket", c.AdminSocket}} {
		if !filepath.IsAbs(p.path) {
			return bad(p.field, "%q: must be an absolute path", p.path)
		}
	}
	if c.ZtunnelSocket == c.CNISocket || c.AdminSocket == c.CNISocket || c.AdminSocket == c.ZtunnelSocket {
		return bad("CNISocket", "%q: the ztunnel socket %q, the CNI socket and the admin socket %q must differ", c.CNISocket, c.ZtunnelSocket, c.AdminSocket)
	}
	for _, a := range []struct{ field, addr string }{{"HealthAddr", c.HealthAddr}, {"MetricsAddr", c.MetricsAddr}, {"PprofAddr", c.PprofAddr}} {
		if a.addr == "" && a.field == "PprofAddr" {
			continue // off
		}
		if _, _, err := net.SplitHostPort(a.addr); err != nil {
			return bad(a.field, "%q: want host:port: %w", a.addr, err)
		}
	}
	// Below a second the probe is most of the connection's traffic;
	// above five minutes a hung ztunnel black-holes its pods that long.
	if d := c.ZtunnelProbeInterval; d != 0 && (d < time.Second || d > 5*time.Minute) {
		return bad("ZtunnelProbeInterval", "%v: want 1s to 5m", d)
	}
	if err := c.Agent.Validate(); err != nil {
		var se *agent.SettingError
		if errors.As(err, &se) {
			return &agent.SettingError{Field: "Agent." + se.Field, Err: se.Err}
		}
		return err
	}
	return nil
}
