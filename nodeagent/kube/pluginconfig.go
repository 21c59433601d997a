package kube

import (
	"fmt"
	"os"

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
