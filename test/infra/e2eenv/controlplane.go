package e2eenv

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Identities in the static token file.
const (
	AdminUser = "e2e-admin" // in group system:masters
	// AgentNamespace and AgentServiceAccount name the agent's identity; its
	// token authenticates as system:serviceaccount:istio-system:ambientd, so
	// the RBAC of deploy/rbac.yaml is what authorizes it.
	AgentNamespace      = "istio-system"
	AgentServiceAccount = "ambientd"
)

// AgentUser is the user name the agent's token authenticates as.
const AgentUser = "system:serviceaccount:" + AgentNamespace + ":" + AgentServiceAccount

// ControlPlaneConfig says where the binaries are and where to put state.
type ControlPlaneConfig struct {
	EtcdBin, APIServerBin string
	Dir                   string // work directory (certs, tokens, etcd data, logs, kubeconfigs)
	// ExtraAPIServerArgs are appended to the apiserver's flags (a flag
	// given again wins: the apiserver keeps the last value).
	ExtraAPIServerArgs []string
	// ServingIPs are more addresses the serving certificate is valid for,
	// beside 127.0.0.1 and ::1: for clients in other network namespaces
	// that reach the apiserver over a link (with --bind-address=0.0.0.0 in
	// ExtraAPIServerArgs).
	ServingIPs []net.IP
	// ReadyTimeout bounds the wait for etcd health and apiserver /readyz
	// (default 2 minutes: the machine may be busy building).
	ReadyTimeout time.Duration
}

// ControlPlane is a running etcd + kube-apiserver on 127.0.0.1.
type ControlPlane struct {
	URL             string // https://127.0.0.1:<port>
	CAFile          string // the self-signed serving certificate
	AdminKubeconfig string
	AgentKubeconfig string
	AdminToken      string
	AgentToken      string
	AdminConfig     *rest.Config
	AgentConfig     *rest.Config
	Admin           kubernetes.Interface // system:masters
	Agent           kubernetes.Interface // the agent's service account, bound by deploy/rbac.yaml
	Etcd            *Process
	APIServer       *Process
	// AuditLog is the apiserver's audit log (JSON lines, audit.k8s.io/v1
	// Events at Metadata level, every user but the test's admin):
	// AuditRequests reads it.
	AuditLog string
	// StartupTime is from starting etcd to the apiserver answering /readyz.
	StartupTime time.Duration
}

// startControlPlane starts etcd and kube-apiserver on loopback with free
// ports and waits until /readyz answers ok. On error everything started is
// stopped again.
func startControlPlane(ctx context.Context, sp *spawner, cfg ControlPlaneConfig) (cp *ControlPlane, err error) {
	if cfg.ReadyTimeout == 0 {
		cfg.ReadyTimeout = 2 * time.Minute
	}
	start := time.Now()
	pki := filepath.Join(cfg.Dir, "pki")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		return nil, err
	}
	cp = &ControlPlane{AdminToken: randHex(16), AgentToken: randHex(16)}
	defer func() {
		if err != nil {
			_ = cp.Stop()
		}
	}()

	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	etcdClient := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	etcdPeer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	apiPort := ports[2]
	cp.URL = "https://127.0.0.1:" + strconv.Itoa(apiPort)

	certFile, keyFile := filepath.Join(pki, "serving.crt"), filepath.Join(pki, "serving.key")
	if err := writeServingCert(certFile, keyFile, cfg.ServingIPs); err != nil {
		return nil, err
	}
	cp.CAFile = certFile
	saPub, saKey := filepath.Join(pki, "sa.pub"), filepath.Join(pki, "sa.key")
	if err := writeKeyPair(saPub, saKey); err != nil {
		return nil, err
	}
	tokens := filepath.Join(pki, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(tokenFile(cp.AdminToken, cp.AgentToken)), 0o600); err != nil {
		return nil, err
	}

	cp.Etcd = newProcess(sp, "etcd", cfg.EtcdBin, filepath.Join(cfg.Dir, "etcd.log"),
		"--name=e2e",
		"--data-dir="+filepath.Join(cfg.Dir, "etcd"),
		"--listen-client-urls="+etcdClient,
		"--advertise-client-urls="+etcdClient,
		"--listen-peer-urls="+etcdPeer,
		"--initial-advertise-peer-urls="+etcdPeer,
		"--initial-cluster=e2e="+etcdPeer,
		"--initial-cluster-state=new",
		// Throwaway data: skip fsync, the single biggest startup and
		// write cost on a loaded machine.
		"--unsafe-no-fsync=true",
		"--log-level=warn",
	)
	if err := cp.Etcd.Start(); err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, cfg.ReadyTimeout)
	defer cancel()
	plain := &http.Client{Timeout: 5 * time.Second}
	if err := cp.Etcd.WaitUntil(rctx, "etcd /health", 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		body, code, err := get(ctx, plain, etcdClient+"/health", "")
		return err == nil && code == 200 && strings.Contains(body, `"health":"true"`), fmt.Errorf("%d %s %v", code, body, err)
	}); err != nil {
		return nil, err
	}

	auditPolicy := filepath.Join(cfg.Dir, "audit-policy.yaml")
	if err := os.WriteFile(auditPolicy, []byte(auditPolicyYAML), 0o600); err != nil {
		return nil, err
	}
	cp.AuditLog = filepath.Join(cfg.Dir, "audit.log")
	args := []string{
		"--audit-policy-file=" + auditPolicy,
		"--audit-log-path=" + cp.AuditLog,
		"--audit-log-format=json",
		"--audit-log-mode=blocking", // written before the response: a test reads it right after
		"--etcd-servers=" + etcdClient,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(apiPort),
		"--tls-cert-file=" + certFile,
		"--tls-private-key-file=" + keyFile,
		"--cert-dir=" + pki,
		"--token-auth-file=" + tokens,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saPub,
		"--service-account-signing-key-file=" + saKey,
		"--service-cluster-ip-range=10.96.0.0/16",
		// No kubelet or controllers run; nothing must try to maintain the
		// kubernetes service's endpoints pointing at loopback.
		"--endpoint-reconciler-type=none",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=1",
	}
	args = append(args, cfg.ExtraAPIServerArgs...)
	cp.APIServer = newProcess(sp, "kube-apiserver", cfg.APIServerBin, filepath.Join(cfg.Dir, "kube-apiserver.log"), args...)
	if err := cp.APIServer.Start(); err != nil {
		return nil, err
	}

	if cp.AdminConfig, err = cp.restConfig(cp.AdminToken); err != nil {
		return nil, err
	}
	if cp.AgentConfig, err = cp.restConfig(cp.AgentToken); err != nil {
		return nil, err
	}
	if err := cp.WaitReady(rctx); err != nil {
		return nil, err
	}
	cp.StartupTime = time.Since(start)

	cp.AdminKubeconfig = filepath.Join(cfg.Dir, "admin.kubeconfig")
	cp.AgentKubeconfig = filepath.Join(cfg.Dir, "agent.kubeconfig")
	if err := cp.writeKubeconfig(cp.AdminKubeconfig, AdminUser, cp.AdminToken); err != nil {
		return nil, err
	}
	if err := cp.writeKubeconfig(cp.AgentKubeconfig, AgentServiceAccount, cp.AgentToken); err != nil {
		return nil, err
	}
	if cp.Admin, err = kubernetes.NewForConfig(cp.AdminConfig); err != nil {
		return nil, err
	}
	if cp.Agent, err = kubernetes.NewForConfig(cp.AgentConfig); err != nil {
		return nil, err
	}
	return cp, nil
}

// WaitReady polls the apiserver's /readyz until it answers ok. Use it after
// restarting cp.APIServer.
func (cp *ControlPlane) WaitReady(ctx context.Context) error {
	hc, err := rest.HTTPClientFor(cp.AdminConfig)
	if err != nil {
		return err
	}
	hc.Timeout = 5 * time.Second
	return cp.APIServer.WaitUntil(ctx, "kube-apiserver /readyz", 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		body, code, err := get(ctx, hc, cp.URL+"/readyz", "")
		return err == nil && code == 200 && body == "ok", fmt.Errorf("%d %q %v", code, truncate(body, 300), err)
	})
}

// RESTConfig returns a client config that authenticates with token.
func (cp *ControlPlane) restConfig(token string) (*rest.Config, error) {
	ca, err := os.ReadFile(cp.CAFile)
	if err != nil {
		return nil, err
	}
	return &rest.Config{
		Host:            cp.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		QPS:             200,
		Burst:           400,
		Timeout:         30 * time.Second,
	}, nil
}

func (cp *ControlPlane) writeKubeconfig(path, user, token string) error {
	return cp.writeKubeconfigVia(path, cp.URL, user, token)
}

// WriteAgentKubeconfigVia writes a kubeconfig of the agent's identity that
// reaches the apiserver at host ("10.251.0.1"), on the apiserver's port, for
// an agent in a network namespace of its own (host must be one of
// ControlPlaneConfig.ServingIPs).
func (cp *ControlPlane) WriteAgentKubeconfigVia(path, host string) error {
	u, err := url.Parse(cp.URL)
	if err != nil {
		return err
	}
	u.Host = net.JoinHostPort(host, u.Port())
	return cp.writeKubeconfigVia(path, u.String(), AgentServiceAccount, cp.AgentToken)
}

func (cp *ControlPlane) writeKubeconfigVia(path, server, user, token string) error {
	ca, err := os.ReadFile(cp.CAFile)
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, []byte(kubeconfig(server, ca, user, token)), 0o600); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}

// kubeconfig renders a one-cluster, one-user kubeconfig. Written by hand
// rather than with clientcmd, which would pull modules the main module does
// not otherwise need.
func kubeconfig(server string, caPEM []byte, user, token string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    token: %s
contexts:
- name: e2e
  context:
    cluster: e2e
    user: %s
current-context: e2e
`, server, base64.StdEncoding.EncodeToString(caPEM), user, token, user)
}

// Stop stops the apiserver, then etcd (SIGTERM, then SIGKILL after 10s).
func (cp *ControlPlane) Stop() error {
	var errs []error
	if cp.APIServer != nil {
		errs = append(errs, cp.APIServer.Stop(10*time.Second))
	}
	if cp.Etcd != nil {
		errs = append(errs, cp.Etcd.Stop(10*time.Second))
	}
	return errors.Join(errs...)
}

// tokenFile renders the apiserver's static token file: token,user,uid,"groups".
func tokenFile(adminToken, agentToken string) string {
	return fmt.Sprintf("%s,%s,e2e-admin-uid,\"system:masters\"\n%s,%s,e2e-agent-uid,\"system:serviceaccounts,system:serviceaccounts:%s,system:authenticated\"\n",
		adminToken, AdminUser, agentToken, AgentUser, AgentNamespace)
}

func writeServingCert(certFile, keyFile string, extraIPs []net.IP) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "ambientd-e2e-apiserver"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true, // self-signed: clients trust it as its own CA
		IPAddresses:           append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, extraIPs...),
		DNSNames:              []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return err
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(keyFile, "PRIVATE KEY", kb)
}

func writeKeyPair(pubFile, keyFile string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	pb, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	if err := writePEM(keyFile, "PRIVATE KEY", kb); err != nil {
		return err
	}
	return writePEM(pubFile, "PUBLIC KEY", pb)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// freePorts reserves n distinct loopback TCP ports by listening on :0, and
// releases them for the caller's processes to bind. Inside the fresh node
// netns nothing else competes for them.
func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("reserve a loopback port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// FreeAddr returns a free 127.0.0.1:port address.
func FreeAddr() (string, error) {
	p, err := freePorts(1)
	if err != nil {
		return "", err
	}
	return "127.0.0.1:" + strconv.Itoa(p[0]), nil
}

func get(ctx context.Context, c *http.Client, url, token string) (string, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", 0, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return string(b), resp.StatusCode, err
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
