package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sync"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// PluginKubeconfig returns a func that renders the agent's own client
// configuration as a self-contained kubeconfig for the CNI plugin, which
// reads the API with it only while no agent answers (a pod's namespace and
// labels, the agent's DaemonSet). Files the configuration names (the
// in-cluster token, rotated by the kubelet, and CA) are read at every call,
// so the installer's periodic rewrite keeps the copy fresh. The plugin's
// rights are the agent's: no wider.
func PluginKubeconfig(cfg *rest.Config) func() ([]byte, error) {
	return func() ([]byte, error) {
		read := func(data []byte, file, what string) ([]byte, error) {
			if len(data) > 0 || file == "" {
				return data, nil
			}
			b, err := os.ReadFile(file)
			if err != nil {
				return nil, fmt.Errorf("reading the agent's %s: %w", what, err)
			}
			return b, nil
		}
		ca, err := read(cfg.CAData, cfg.CAFile, "CA")
		if err != nil {
			return nil, err
		}
		cert, err := read(cfg.CertData, cfg.CertFile, "client certificate")
		if err != nil {
			return nil, err
		}
		key, err := read(cfg.KeyData, cfg.KeyFile, "client key")
		if err != nil {
			return nil, err
		}
		token, err := read([]byte(cfg.BearerToken), cfg.BearerTokenFile, "token")
		if err != nil {
			return nil, err
		}
		if len(ca) == 0 && !cfg.Insecure {
			return nil, fmt.Errorf("the agent's client configuration for %s has no CA", cfg.Host)
		}
		kc := clientcmdapi.NewConfig()
		kc.Clusters["cluster"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: ca, TLSServerName: cfg.ServerName, InsecureSkipTLSVerify: cfg.Insecure}
		kc.AuthInfos["ambientd"] = &clientcmdapi.AuthInfo{Token: string(token), ClientCertificateData: cert, ClientKeyData: key}
		kc.Contexts["ambientd-cni"] = &clientcmdapi.Context{Cluster: "cluster", AuthInfo: "ambientd"}
		kc.CurrentContext = "ambientd-cni"
		return clientcmd.Write(*kc)
	}
}

// PluginToken mints the plugin's credentials for a service account of
// their own (the chart's ambientd-cni, which may only read pods,
// namespaces and the agent's DaemonSet) through the TokenRequest API: an
// unbound token of ttl, so that it outlives the agent pod whose own token
// dies with it (a rolling update to an image that cannot be pulled, a
// deleted DaemonSet). It is minted again once half its life is gone; the
// installer writes the result at every lease renewal. Server and CA are
// the agent's.
type PluginToken struct {
	cfg           *rest.Config
	http          *http.Client
	namespace, sa string
	ttl           time.Duration
	now           func() time.Time

	mu      sync.Mutex
	token   string
	expires time.Time
	minted  time.Time
}

// NewPluginToken returns the minter for namespace/serviceAccount.
func NewPluginToken(cfg *rest.Config, namespace, serviceAccount string, ttl time.Duration) (*PluginToken, error) {
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("plugin token: %w", err)
	}
	return &PluginToken{cfg: cfg, http: hc, namespace: namespace, sa: serviceAccount, ttl: ttl, now: time.Now}, nil
}

// Kubeconfig returns the plugin's kubeconfig, minting a token first when
// none is held or half its life is gone.
func (p *PluginToken) Kubeconfig() ([]byte, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	if p.token == "" || now.After(p.minted.Add(p.expires.Sub(p.minted)/2)) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		token, expires, err := p.mint(ctx)
		if err != nil {
			return nil, err
		}
		if expires.IsZero() {
			expires = now.Add(p.ttl)
		}
		p.token, p.expires, p.minted = token, expires, now
	}
	cfg := rest.AnonymousClientConfig(p.cfg)
	cfg.BearerToken = p.token
	return PluginKubeconfig(cfg)()
}

// tokenRequest and tokenStatus are the JSON of authentication.k8s.io/v1
// TokenRequest that the minter writes and reads (the agent binary links no
// authentication API group: docs/scale.md, "Lean binary").
type tokenRequest struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Spec       struct {
		ExpirationSeconds int64 `json:"expirationSeconds"`
	} `json:"spec"`
}

type tokenStatus struct {
	Status struct {
		Token               string    `json:"token"`
		ExpirationTimestamp time.Time `json:"expirationTimestamp"`
	} `json:"status"`
}

func (p *PluginToken) mint(ctx context.Context) (string, time.Time, error) {
	what := fmt.Sprintf("TokenRequest for ServiceAccount %s/%s", p.namespace, p.sa)
	req := tokenRequest{APIVersion: "authentication.k8s.io/v1", Kind: "TokenRequest"}
	req.Spec.ExpirationSeconds = int64(p.ttl / time.Second)
	body, err := json.Marshal(req)
	if err != nil {
		return "", time.Time{}, err
	}
	u, err := url.JoinPath(p.cfg.Host, "api", "v1", "namespaces", p.namespace, "serviceaccounts", p.sa, "token")
	if err != nil {
		return "", time.Time{}, fmt.Errorf("%s: %w", what, err)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return "", time.Time{}, err
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Accept", "application/json")
	resp, err := p.http.Do(hr)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("%s: %w", what, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return "", time.Time{}, fmt.Errorf("%s: %w", what, err)
	}
	if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
		return "", time.Time{}, fmt.Errorf("%s: %s: %s", what, resp.Status, bytes.TrimSpace(data))
	}
	var st tokenStatus
	if err := json.Unmarshal(data, &st); err != nil || st.Status.Token == "" {
		return "", time.Time{}, fmt.Errorf("%s: no token in the answer (%v)", what, err)
	}
	return st.Status.Token, st.Status.ExpirationTimestamp, nil
}
