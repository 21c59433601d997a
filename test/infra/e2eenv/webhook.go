package e2eenv

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// WebhookConfig configures StartWebhook.
type WebhookConfig struct {
	// Name tells several replicas apart in logs (default "webhook").
	Name string
	// ServiceAccount is the identity the webhook's requests are authorized
	// as (namespace/name): the admin impersonates it, so the RBAC the
	// chart ships for it is what allows or refuses each request.
	ServiceAccount string
	// Args are appended after the defaults (--kubeconfig, --listen,
	// --health-addr, --metrics-addr, --service-name=localhost); a flag
	// given again here wins.
	Args []string
}

// Webhook is a running `bin/ambientd webhook`.
type Webhook struct {
	*Process
	// URL is where the apiserver reaches its admission endpoint; the
	// serving certificate is for localhost (--service-name=localhost).
	URL                     string
	HealthAddr, MetricsAddr string
}

// StartWebhook starts `bin/ambientd webhook` on loopback ports; it does not
// wait for readiness (WaitReady).
func (e *Env) StartWebhook(ctx context.Context, cfg WebhookConfig) (*Webhook, error) {
	if err := requireBinary(e.Bins.Agent); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		cfg.Name = "webhook"
	}
	ns, sa, ok := strings.Cut(cfg.ServiceAccount, "/")
	if !ok {
		return nil, fmt.Errorf("webhook service account %q: want namespace/name", cfg.ServiceAccount)
	}
	kc := filepath.Join(e.Dir, cfg.Name+".kubeconfig")
	if err := e.CP.writeImpersonatingKubeconfig(kc, ns, sa); err != nil {
		return nil, err
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	addr := func(i int) string { return fmt.Sprintf("127.0.0.1:%d", ports[i]) }
	args := append([]string{"webhook", "--kubeconfig=" + kc, "--listen=" + addr(0), "--health-addr=" + addr(1),
		"--metrics-addr=" + addr(2), "--service-name=localhost"}, cfg.Args...)
	p := newProcess(e.sp, cfg.Name, e.Bins.Agent, e.logPath(cfg.Name), args...)
	if err := p.Start(); err != nil {
		return nil, err
	}
	e.trackProcess(p)
	return &Webhook{Process: p, URL: fmt.Sprintf("https://localhost:%d/mutate-pods", ports[0]), HealthAddr: addr(1), MetricsAddr: addr(2)}, nil
}

// WaitReady polls /readyz until it answers 200 (caches synced, a serving
// certificate in place).
func (w *Webhook) WaitReady(ctx context.Context) error {
	c := &http.Client{Timeout: 2 * time.Second}
	return w.WaitUntil(ctx, "webhook /readyz", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		body, code, err := get(ctx, c, "http://"+w.HealthAddr+"/readyz", "")
		return err == nil && code == 200, fmt.Errorf("%d %q %v", code, truncate(body, 200), err)
	})
}

// Metrics returns the webhook's Prometheus text exposition.
func (w *Webhook) Metrics(ctx context.Context) (string, error) {
	body, code, err := get(ctx, &http.Client{Timeout: 5 * time.Second}, "http://"+w.MetricsAddr+"/metrics", "")
	if err == nil && code != 200 {
		err = fmt.Errorf("/metrics: HTTP %d", code)
	}
	return body, err
}

// writeImpersonatingKubeconfig writes a kubeconfig of the admin that
// impersonates the service account ns/name with its groups.
func (cp *ControlPlane) writeImpersonatingKubeconfig(path, ns, name string) error {
	ca, err := os.ReadFile(cp.CAFile)
	if err != nil {
		return err
	}
	user := "system:serviceaccount:" + ns + ":" + name
	kc := strings.Replace(kubeconfig(cp.URL, ca, AdminUser, cp.AdminToken), "    token: "+cp.AdminToken+"\n", fmt.Sprintf(
		"    token: %s\n    as: %s\n    as-groups: [system:serviceaccounts, \"system:serviceaccounts:%s\", system:authenticated]\n",
		cp.AdminToken, user, ns), 1)
	return os.WriteFile(path, []byte(kc), 0o600)
}
