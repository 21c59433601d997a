// Package agent is the node agent's core: it watches this node's pods and all
// namespaces, decides with the enrollment policy which pods belong in the mesh,
// and drives each pod through its lifecycle phases (see registry.Phase) —
// rules in its network namespace, ztunnel told, probe IPs registered, status
// written — with one per-pod sync used by the workqueue and by CNI ADD alike
// (the sample-controller shape). CNI events come in through its edge (CNI,
// cniedge.go), which decides each ADD's mode and hands sidecar pods to
// sidecar mode. It knows no transport: it returns domain
// errors (ErrPodUnknown, …) that the CNI server maps to gRPC codes, and it
// supervises no listener: nodeagent/daemon runs it beside the servers.
//
// The agent holds no package-level state; everything lives in an Agent.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/listers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/podstatus"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/policy"
)

// Agent is the node agent. Create with New, then Run.
type Agent struct {
	cfg     Config
	client  kube.Interface
	log     *slog.Logger
	zt      Ztunnel
	rules   Rules
	reg     *registry.Registry
	finder  Netns
	state   *podnetns.State // nil without a RunDir
	status  *podstatus.Patcher
	metrics *metrics
	gates   missingGates // pods lacking the readiness gate (missinggate.go)

	recorder record.EventRecorder // pod Events

	podInformer cache.SharedIndexInformer
	nsInformer  cache.SharedIndexInformer
	nsLister    listers.ResourceIndexer[*corev1.Namespace]
	rcLister    listers.ResourceIndexer[*nodev1.RuntimeClass] // runtimeVerdict
	queue       workqueue.TypedRateLimitingInterface[string]  // pod uids
	podSeen     broadcast                                     // fires on every pod event

	// decide applies the enrollment policy to a pod: decidePolicy (a
	// test counts the decisions through it).
	decide func(ctx context.Context, pod *corev1.Pod) (policy.Decision, error)

	locks keyedMutex
	// adds holds a token per CNI ADD enrolling (Config.MaxParallelAdds).
	adds chan struct{}

	// refused holds the uids a ztunnel refused in its snapshot, until
	// their next sync takes them (under the per-pod lock) back to pending.
	refused uidSet
	// moved holds the uids whose phase a running sync moved.
	moved uidSet
	// readds holds the pods a closed ztunnel held, for their sync to Add
	// to the newest one (readd.go).
	readds readdSet
	// invalid remembers the invalid annotation values already reported.
	invalid invalidSeen

	// served follows whether a ztunnel serves the node (served.go).
	served servedState

	lastAck   atomic.Int64 // unix nanos of the last ztunnel snapshot ack
	synced    atomic.Bool  // informer caches synced
	running   atomic.Bool  // rebuild done, workers started
	liveLoops atomic.Int32
	wantLoops int32
}

// New builds an agent from d. The agent is the ztunnel server's snapshot
// source (Snapshot, SnapshotRefused, Readd).
func New(cfg Config, d Deps) (*Agent, error) {
	cfg = cfg.withDefaults()
	if cfg.NodeName == "" {
		return nil, errors.New("agent: node name is required")
	}
	if d.Client == nil || d.Informers == nil || d.Recorder == nil || d.Ztunnel == nil || d.Rules == nil || d.Registry == nil {
		return nil, errors.New("agent: Client, Informers, Recorder, Ztunnel, Rules and Registry are all required")
	}
	log, client, reg := d.Log, d.Client, d.Registry
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Agent{
		cfg:      cfg,
		client:   client,
		log:      log.With("component", "agent"),
		zt:       d.Ztunnel,
		rules:    d.Rules,
		reg:      reg,
		recorder: d.Recorder,
		finder:   d.Netns,
		adds:     make(chan struct{}, cfg.MaxParallelAdds),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.RetryBaseDelay, cfg.RetryMaxDelay),
			workqueue.TypedRateLimitingQueueConfig[string]{}),
	}
	a.decide = a.decidePolicy
	if a.finder == nil {
		a.finder = podnetns.New(cfg.HostProc)
	}
	if cfg.ZtunnelGrace < 0 {
		return nil, fmt.Errorf("agent: ztunnel grace %v: want 0 (off) or more", cfg.ZtunnelGrace)
	}
	if errs := validation.IsQualifiedName(cfg.PodConditionType); len(errs) > 0 {
		return nil, fmt.Errorf("agent: pod condition type %q: %s", cfg.PodConditionType, strings.Join(errs, "; "))
	}
	if cfg.RunDir != "" {
		st, err := podnetns.OpenState(filepath.Join(cfg.RunDir, "pods.json"))
		if err != nil {
			log.Warn("pod state file unusable; restarts fall back to the /proc scan", "error", err)
		}
		a.state = st
	}
	a.metrics = newMetrics(reg, a.queue.Len)
	a.status = podstatus.New(client, log.With("component", "podstatus"), podstatus.Options{
		ConditionType: cfg.PodConditionType,
		OnResult: func(r podstatus.Result, took time.Duration) {
			a.metrics.annotations.WithLabelValues(string(r)).Inc()
			a.metrics.steps.WithLabelValues("status_write").Observe(took.Seconds())
		},
		OnWritten: a.metrics.meshReady,
	})
	if err := a.watch(d.Informers, d.Istio); err != nil {
		return nil, err
	}
	return a, nil
}
