package main

import (
	"log/slog"

	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/nodeagent/kube"
)

// writeStartLease renews the install lease, and the plugin's kubeconfig
// when the agent's client configuration can be read, at process start.
func writeStartLease(f runFlags, log *slog.Logger) error {
	cfg, err := f.leaseConfig()
	if err != nil {
		return err
	}
	if restCfg, err := kubeConfig(f.kubeconfig); err == nil {
		if cfg.Credentials, err = f.pluginCredentials(restCfg); err != nil {
			log.Warn("cannot make the plugin's credentials", "error", err)
		}
	}
	inst, err := cniinstall.New(cfg, log)
	if err != nil {
		return err
	}
	return inst.WriteLease()
}

// leaseConfig is the installer's config with what the install lease tells
// the plugin for while no agent answers: the agent's DaemonSet and its
// enrollment policy.
func (f runFlags) leaseConfig() (cniinstall.Config, error) {
	cfg, err := f.install.config(f.node.CNISocket, f.node.Agent.Policy.ExcludeNamespaces)
	if err != nil {
		return cfg, err
	}
	p := f.node.Agent.Policy
	cfg.DaemonSetNamespace, cfg.DaemonSetName = f.install.namespace, f.install.daemonSet
	cfg.Policy = &cniapi.LeasePolicy{
		ExcludeNamespaces: f.node.Agent.Policy.ExcludeNamespaces, SystemNamespace: p.SystemNamespace,
		ZtunnelLabels: p.ZtunnelLabels, SelfLabels: p.SelfLabels, Sidecar: !f.node.Sidecar.Disabled,
	}
	return cfg, nil
}

// pluginCredentials is what the installer writes as the plugin's
// kubeconfig: tokens minted for --cni-plugin-service-account, or the
// agent's own credentials.
func (f runFlags) pluginCredentials(restCfg *rest.Config) (func() ([]byte, error), error) {
	if f.install.pluginServiceAccount == "" {
		return kube.PluginKubeconfig(restCfg), nil
	}
	p, err := kube.NewPluginToken(restCfg, f.install.namespace, f.install.pluginServiceAccount, f.install.pluginTokenTTL)
	if err != nil {
		return nil, err
	}
	return p.Kubeconfig, nil
}
