package daemon

import (
	"context"
	"fmt"
	"log/slog"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"

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

// sidecarParts wires sidecar mode into the agent and returns its
// components: the tracker (restart verification, drift pass) and the
// repair controller, each recording Events while it runs.
func sidecarParts(cfg Config, client kube.Interface, rules agent.Rules, a *agent.Agent, log *slog.Logger) ([]Component, error) {
	if cfg.Sidecar.Disabled {
		return nil, nil
	}
	sr, ok := rules.(sidecar.Rules)
	if !ok {
		return nil, fmt.Errorf("sidecar mode: the rule manager %T cannot program sidecar rules", rules)
	}
	node := cfg.Agent.NodeName
	events, recorder := broadcaster(node, "ambientd")
	tr, err := sidecar.New(sidecar.Config{
		NodeName: node, Policy: cfg.Agent.Policy, HostProc: cfg.Agent.HostProc, VerifyInterval: cfg.Agent.VerifyInterval,
	}, sr, a.PodInformer(), recorder, a.Metrics(), log)
	if err != nil {
		return nil, err
	}
	a.SetSidecar(tr, sidecar.ErrInvalidAnnotation)
	rc := cfg.Sidecar.Repair
	rc.NodeName = node
	repairEvents, repairRecorder := broadcaster(node, repair.EventComponent)
	ctl, err := repair.New(rc, client, a.PodInformer(), tr, repairRecorder, a.Metrics(), log)
	if err != nil {
		return nil, err
	}
	return []Component{
		Func("sidecar mode", withEvents(client, events, tr.Run)),
		Func("repair controller", withEvents(client, repairEvents, ctl.Run)),
	}, nil
}

func broadcaster(node, component string) (record.EventBroadcaster, record.EventRecorder) {
	b := record.NewBroadcaster()
	return b, b.NewRecorder(kube.NewScheme(), corev1.EventSource{Component: component, Host: node})
}

// withEvents sends b's Events to the API while run runs.
func withEvents(client kube.Interface, b record.EventBroadcaster, run func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		b.StartRecordingToSink(kube.EventSink{Client: client.CoreV1()})
		defer b.Shutdown()
		return run(ctx)
	}
}
