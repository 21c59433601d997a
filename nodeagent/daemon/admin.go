package daemon

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/unixsock"
)

// adminServer serves `ambientd status` on the admin socket (mode 0600, root
// peers only): ready once it listens, the socket removed at stop if still ours.
func (n *Process) adminServer() Component {
	path := n.cfg.AdminSocket
	if path == "" {
		path = admin.DefaultSocketPath
	}
	return Staged("admin server "+path, func(ctx context.Context, ready func()) error {
		ln, sock, err := unixsock.Listen(path, "unix", 0o600)
		if err != nil {
			return fmt.Errorf("admin: %w", err)
		}
		defer sock.RemoveIfOurs(n.log)
		n.log.Info("serving admin API", "socket", path)
		return serveHTTP(ctx, ready, ln, &http.Server{
			Handler:           admin.Handler(adminSource{n}, n.log),
			ReadHeaderTimeout: 5 * time.Second,
			WriteTimeout:      30 * time.Second, // answers are small; a stuck reader is not waited for
			ConnContext:       admin.ConnContext,
		})
	})
}

// adminSource answers `ambientd status` from the agent, the ztunnel server
// and the status providers other parts register (Config.StatusProviders).
type adminSource struct{ n *Process }

func (s adminSource) NodeStatus(context.Context) admin.NodeStatus {
	n := s.n
	zs := n.zt.Status()
	st := admin.NodeStatus{
		Node:          n.cfg.Agent.NodeName,
		Time:          time.Now().UTC(),
		Version:       n.cfg.Version,
		NotReady:      []string{},
		Ztunnel:       admin.ZtunnelStatus{Connections: zs.Connections, SnapshotAcked: zs.SnapshotAcked},
		Plugin:        admin.Unknown,
		Taint:         admin.Unknown,
		NodeReadiness: admin.Unknown,
		Phases:        map[string]int{},
		Pods:          []admin.Pod{},
	}
	if err := n.Ready(); err != nil {
		st.NotReady = append(st.NotReady, err.Error())
	}
	for _, p := range n.agent.Pods() {
		st.Phases[p.Phase.String()]++
		st.Pods = append(st.Pods, podOf(p))
	}
	for _, f := range n.cfg.StatusProviders {
		f(&st)
	}
	return st
}

func (s adminSource) PodDetail(ctx context.Context, namespace, name string) (admin.PodDetail, error) {
	st := s.NodeStatus(ctx)
	for _, p := range st.Pods {
		if p.Name != name || (namespace != "" && p.Namespace != namespace) {
			continue
		}
		d := admin.PodDetail{Pod: p}
		rules, err := s.n.agent.PodRules(ctx, p.UID)
		if err != nil {
			d.RulesError = err.Error()
		}
		d.Rules = rules
		return d, nil
	}
	return admin.PodDetail{}, fmt.Errorf("%s/%s: %w", namespace, name, admin.ErrNotFound)
}

func podOf(v agent.PodView) admin.Pod {
	return admin.Pod{
		UID: v.UID, Namespace: v.Namespace, Name: v.Name,
		Phase:        v.Phase.String(),
		Annotation:   v.Annotation,
		ZtunnelAcked: v.Phase == registry.Enabled,
		LastError:    v.LastError,
		Created:      v.Created,
		IPs:          v.IPs,
		Netns:        v.Netns,
		MissingGate:  v.MissingGate,
	}
}

// registerPluginCheck exports cfg.PluginInstalled as a gauge and a status
// field; without a check there is neither.
func registerPluginCheck(cfg *Config, reg *prometheus.Registry) error {
	check := cfg.PluginInstalled
	if check == nil {
		return nil
	}
	if err := reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "ambientd_cni_plugin_installed",
		Help: "1 when our CNI plugin is in the node's CNI config, else 0.",
	}, func() float64 {
		if check() != nil {
			return 0
		}
		return 1
	})); err != nil {
		return fmt.Errorf("register plugin metric: %w", err)
	}
	if lease := cfg.InstallLease; lease != nil {
		if err := reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ambientd_cni_install_lease_written",
			Help: "1 when the last write of the install lease and the plugin's kubeconfig worked, else 0.",
		}, func() float64 {
			if lease() != nil {
				return 0
			}
			return 1
		})); err != nil {
			return fmt.Errorf("register lease metric: %w", err)
		}
	}
	cfg.StatusProviders = append(cfg.StatusProviders, func(st *admin.NodeStatus) {
		st.Plugin = "installed"
		if err := check(); err != nil {
			st.Plugin = "missing: " + err.Error()
		}
	})
	return nil
}
