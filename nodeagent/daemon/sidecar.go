package daemon

import (
	"fmt"
	"log/slog"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/repair"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
)

// SidecarConfig configures sidecar mode (docs/sidecar.md): the capture of
// pods with an injected istio-proxy, and the repair controller.
type SidecarConfig struct {
	// Disabled leaves sidecar pods alone (their CNI ADD succeeds with
	// nothing done, as before sidecar mode).
	Disabled bool
	// Repair configures the repair controller (Mode off: none).
	Repair repair.Config
}

// sidecarParts wires sidecar mode into the agent's CNI edge and returns its
// components: the tracker (restart verification, drift pass) and the
// repair controller, on the process's shared pod informer and Event
// broadcaster.
func sidecarParts(cfg Config, client kube.Interface, rules agent.Rules, a *agent.Agent, edge *agent.CNI, informers *kube.Informers, events *kube.Events, log *slog.Logger) ([]Component, error) {
	if cfg.Sidecar.Disabled {
		return nil, nil
	}
	sr, ok := rules.(sidecar.Rules)
	if !ok {
		return nil, fmt.Errorf("sidecar mode: the rule manager %T cannot program sidecar rules", rules)
	}
	node := cfg.Agent.NodeName
	tr, err := sidecar.New(sidecar.Config{
		NodeName: node, Policy: cfg.Agent.Policy, HostProc: cfg.Agent.HostProc, VerifyInterval: cfg.Agent.VerifyInterval,
	}, sr, informers.Pods, events.Recorder(), a.Metrics(), log)
	if err != nil {
		return nil, err
	}
	edge.SetSidecar(tr, sidecar.ErrInvalidAnnotation)
	rc := cfg.Sidecar.Repair
	rc.NodeName = node
	ctl, err := repair.New(rc, client, informers.Pods, tr, events.RecorderAs(repair.EventComponent), a.Metrics(), log)
	if err != nil {
		return nil, err
	}
	return []Component{
		Func("sidecar mode", tr.Run),
		Func("repair controller", ctl.Run),
	}, nil
}
