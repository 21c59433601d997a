package e2eenv

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// AgentConfig configures StartAgent.
type AgentConfig struct {
	// Args are appended after the default flags (DefaultAgentArgs); a flag
	// given again here wins, as Go's flag package keeps the last value.
	Args []string
	// Env is extra environment for the agent process.
	Env []string
	// Name tells several agents apart in logs (default "agent").
	Name string
}

// Agent is a running bin/ambientd.
type Agent struct {
	*Process
	HealthAddr  string // 127.0.0.1:port of --health-addr
	MetricsAddr string // 127.0.0.1:port of --metrics-addr
}

// DefaultAgentArgs are the flags StartAgent passes before cfg.Args: the agent
// kubeconfig (service account token, deploy/rbac.yaml), this node, the
// environment's sockets, loopback health/metrics ports, no CNI install
// (the environment owns the chain's conflist, whose dir is the agent's
// --cni-conf-dir) and the iptables-nft backend.
func (e *Env) DefaultAgentArgs(healthAddr, metricsAddr string) []string {
	return []string{
		"run",
		"--kubeconfig=" + e.CP.AgentKubeconfig,
		"--node-name=" + e.NodeName,
		"--ztunnel-socket=" + e.ZtunnelSocket,
		"--cni-socket=" + e.CNISocket,
		"--admin-socket=" + e.AdminSocket,
		"--health-addr=" + healthAddr,
		"--metrics-addr=" + metricsAddr,
		"--host-proc=/proc",
		"--install-cni=false",
		"--cni-conf-dir=" + filepath.Dir(e.Chain.ConflistPath),
		// The e2e assertions read iptables-save; the native nftables
		// backend (what auto picks on a clean node) has its own tests in
		// iptables/. A later flag in cfg.Args overrides this.
		"--iptables=nft",
	}
}

// StartAgent starts bin/ambientd as a subprocess (log in the work dir). It
// does not wait for readiness; see (*Agent).WaitReady.
func (e *Env) StartAgent(ctx context.Context, cfg AgentConfig) (*Agent, error) {
	if err := requireBinary(e.Bins.Agent); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		cfg.Name = "agent"
	}
	addrs, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	health := fmt.Sprintf("127.0.0.1:%d", addrs[0])
	metrics := fmt.Sprintf("127.0.0.1:%d", addrs[1])
	for _, s := range []string{e.ZtunnelSocket, e.CNISocket} {
		if err := os.MkdirAll(filepath.Dir(s), 0o755); err != nil {
			return nil, err
		}
	}
	args := append(e.DefaultAgentArgs(health, metrics), cfg.Args...)
	p := newProcess(e.sp, cfg.Name, e.Bins.Agent, e.logPath(cfg.Name), args...)
	// The run dir (pod state file) through the environment, never the
	// machine's /var/run/ambientd; a flag in cfg.Args wins.
	p.Env = append([]string{"AMBIENTD_RUN_DIR=" + e.AgentRunDir}, cfg.Env...)
	if err := p.Start(); err != nil {
		return nil, err
	}
	e.trackProcess(p)
	return &Agent{Process: p, HealthAddr: health, MetricsAddr: metrics}, nil
}

// WaitReady polls GET /readyz on the health address until it answers 200.
func (a *Agent) WaitReady(ctx context.Context) error {
	return a.waitHTTP(ctx, "/readyz")
}

// WaitLive polls GET /healthz until it answers 200.
func (a *Agent) WaitLive(ctx context.Context) error {
	return a.waitHTTP(ctx, "/healthz")
}

func (a *Agent) waitHTTP(ctx context.Context, path string) error {
	c := &http.Client{Timeout: 2 * time.Second}
	return a.WaitUntil(ctx, "agent "+path, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		body, code, err := get(ctx, c, "http://"+a.HealthAddr+path, "")
		return err == nil && code == 200, fmt.Errorf("%d %q %v", code, truncate(body, 200), err)
	})
}

// Metrics returns the agent's Prometheus text exposition.
func (a *Agent) Metrics(ctx context.Context) (string, error) {
	body, code, err := get(ctx, &http.Client{Timeout: 5 * time.Second}, "http://"+a.MetricsAddr+"/metrics", "")
	if err != nil {
		return "", err
	}
	if code != 200 {
		return "", fmt.Errorf("GET /metrics: status %d: %s", code, truncate(body, 200))
	}
	return body, nil
}
