package agent

import (
	"fmt"
	"log/slog"
	"testing"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/registry"
	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// BenchmarkVerifyPass100 is the pod part of one drift pass at 100 enrolled
// pods, on real network namespaces with the real rule manager (every pod's
// rules read back and compared; all intact, so nothing is written). The
// host step is one more read of the node's rules and is left out: a
// benchmark must not touch the machine's own netns.
func BenchmarkVerifyPass100(b *testing.B) {
	testutil.RequireRoot(b)
	const pods = 100
	ctx := b.Context()
	m, err := iptables.NewManager(ctx, iptables.Config{IPv6: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	reg := registry.New()
	cfg := DefaultConfig()
	cfg.NodeName = "node-1"
	deps := sharedDeps(b, kubetest.Wrap(fake.NewClientset()))
	deps.Ztunnel, deps.Rules, deps.Registry = &fakeZtunnel{}, m, reg
	a, err := New(cfg, deps)
	if err != nil {
		b.Fatal(err)
	}
	opts := iptables.PodOptions{DNSCapture: true}
	for i := range pods {
		n := testutil.NewNetNSWith(b, testutil.NetNSOptions{IgnoreRemovalErr: true})
		h, err := podnetns.Open(n.NS.Path())
		if err != nil {
			b.Fatal(err)
		}
		if err := m.ApplyPod(ctx, h, opts); err != nil {
			b.Fatal(err)
		}
		uid := fmt.Sprintf("uid-%03d", i)
		if _, err := reg.Update(uid, func(e *registry.Entry) { e.Netns, e.Phase, e.Options = h, registry.Enabled, opts }); err != nil {
			b.Fatal(err)
		}
		// The pod as the informer caches it (no IPs: the sandbox check
		// is the path check alone).
		if err := a.podInformer.GetIndexer().Add(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: uid, UID: types.UID(uid)}}); err != nil {
			b.Fatal(err)
		}
	}
	b.Cleanup(reg.Close)
	b.ResetTimer()
	for b.Loop() {
		a.verifyEnrolled(ctx)
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/pass")
	var w dto.Metric
	if err := a.metrics.ruleWrites.Write(&w); err != nil || w.GetCounter().GetValue() != 0 {
		b.Fatalf("rule writes for intact pods: %v (%v)", w.GetCounter().GetValue(), err)
	}
}
