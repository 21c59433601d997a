package agent

import (
	"context"
	"log/slog"
	"net/netip"

	"github.com/containernetworking/plugins/pkg/ns"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
)

// Ztunnel is what the agent needs from the ztunnel server
// (*ztunnel.Server implements it).
type Ztunnel interface {
	AddWorkload(ctx context.Context, w ztunnel.Workload, netns *podnetns.Handle) error
	DelWorkload(ctx context.Context, uid string) error
	SubscribeSnapshotAcked() (<-chan struct{}, func())
	// SubscribeStatus is signalled on every change of Status (a ztunnel
	// connected, acked its snapshot, or left).
	SubscribeStatus() (<-chan struct{}, func())
	Status() ztunnel.Status
}

// Rules is what the agent needs from the rule manager (*iptables.Manager
// implements it). The pod netns is a *podnetns.Handle, passed as ns.NetNS.
type Rules interface {
	ApplyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) error
	DeletePod(ctx context.Context, podNS ns.NetNS) error
	VerifyPod(ctx context.Context, podNS ns.NetNS, opts iptables.PodOptions) (iptables.Drift, error)
	AddProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error
	RemoveProbeIPs(ctx context.Context, uid string, ips []netip.Addr) error
	PruneProbeIPs(ctx context.Context, live map[string][]netip.Addr) (iptables.ProbeChanges, error)
	// RepairHostRules verifies the node's host rules (probe SNAT and its
	// jump) and repairs them, reporting what it repaired.
	RepairHostRules(ctx context.Context) (iptables.Drift, error)
	// DumpPod reads the live rules of a pod's netns, changing nothing.
	DumpPod(ctx context.Context, podNS ns.NetNS) (string, error)
}

// Netns is how the agent reaches pods' network namespaces: it opens the
// one a CNI ADD names, tells the node's own apart, checks that a held one
// is still the pod's (its addresses) and finds running pods' in the host's
// /proc. *podnetns.Finder is the real one (New takes podnetns.New of
// Config.HostProc when Deps.Netns is nil); unit tests of the agent's logic
// hand it a fake, so they need no network namespace of their own.
type Netns interface {
	Open(path string) (*podnetns.Handle, error)
	IsHost(h *podnetns.Handle) bool
	Accept(h *podnetns.Handle, ips []netip.Addr) error
	Current(h *podnetns.Handle, ips []netip.Addr) (ok bool, why string, err error)
	Find(ctx context.Context, targets []podnetns.Target) (map[string]*podnetns.Handle, error)
	FindOne(ctx context.Context, t podnetns.Target) (*podnetns.Handle, error)
}

// Deps are what an Agent works with. The daemon builds them once and
// shares them with the process's other parts; all are required.
type Deps struct {
	Client kube.Interface
	// Informers: the agent watches this node's pods, every namespace and
	// every RuntimeClass through them. It adds its transforms, indexers
	// and handlers in New; the owner starts them afterwards and stops
	// them after Run returned.
	Informers *kube.Informers
	// Recorder records the pods' Events (kube.Events).
	Recorder record.EventRecorder
	Ztunnel  Ztunnel
	Rules    Rules
	// Registry is the pod registry; the agent owns it (Run closes it).
	Registry *registry.Registry
	// Netns reaches pods' network namespaces (nil: podnetns.New of
	// Config.HostProc).
	Netns Netns
	Log   *slog.Logger // nil discards
	// Istio counts the informer events under Istio's
	// nodeagent_reconcile_events_total (nil: not counted).
	Istio *istiometrics.Metrics
}
