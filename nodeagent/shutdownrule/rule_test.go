package shutdownrule

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/test/infra/kubetest"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// The decision rule only (pure logic over API objects); the e2e suite reads
// a real DaemonSet with the agent's real rights.
func TestUninstallOnShutdown(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"kubernetes.io/os": "linux", "pool": "a"}}}
	ds := func(mut func(*appsv1.DaemonSet)) *appsv1.DaemonSet {
		d := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "ambientd", Namespace: "istio-system"}}
		d.Spec.Template.Spec.NodeSelector = map[string]string{"kubernetes.io/os": "linux"}
		if mut != nil {
			mut(d)
		}
		return d
	}
	now := metav1.Now()
	affinity := func(op corev1.NodeSelectorOperator, vals ...string) func(*appsv1.DaemonSet) {
		return func(d *appsv1.DaemonSet) {
			d.Spec.Template.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
				RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{
					{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "pool", Operator: op, Values: vals}}},
				}},
			}}
		}
	}
	cases := []struct {
		name string
		ds   *appsv1.DaemonSet
		want bool
	}{
		{"daemonset gone", nil, true},
		{"daemonset being deleted", ds(func(d *appsv1.DaemonSet) { d.DeletionTimestamp = &now; d.Finalizers = []string{"x"} }), true},
		{"upgrade: still selects the node", ds(nil), false},
		{"node selector no longer matches", ds(func(d *appsv1.DaemonSet) { d.Spec.Template.Spec.NodeSelector["pool"] = "b" }), true},
		{"affinity matches", ds(affinity(corev1.NodeSelectorOpIn, "a")), false},
		{"affinity excludes the node", ds(affinity(corev1.NodeSelectorOpNotIn, "a")), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			objs := []runtime.Object{node}
			if tc.ds != nil {
				objs = append(objs, tc.ds)
			}
			objs = append(objs, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "istio-system"}})
			got, reason, err := New(kubetest.Wrap(fake.NewClientset(objs...)), "istio-system", "ambientd", "n1").Decide(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want || reason == "" {
				t.Fatalf("uninstall=%v (%q), want %v", got, reason, tc.want)
			}
		})
	}
}

// When the API refuses the agent at shutdown (401: its token or
// ServiceAccount is gone; 403: its binding is gone), what the agent last
// saw of its DaemonSet through its watch decides: seen deleted or being
// deleted → uninstall; seen alive and selecting the node → keep (a
// force-deleted agent pod or a recreated ServiceAccount while the DaemonSet
// stays: a replacement is coming, and removing the plugin would let ambient
// pods start uncaptured under it). Without a first read a refusal proves
// nothing; a namespace being deleted means uninstall; an API that does not
// answer means keep.
func TestShutdownRuleWhenTheAPIRefuses(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}}
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "ambientd", Namespace: "istio-system"}}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "istio-system"}}
	now := metav1.Now()
	deleting := ns.DeepCopy()
	deleting.DeletionTimestamp, deleting.Finalizers = &now, []string{"kubernetes"}
	gr := schema.GroupResource{Group: "apps", Resource: "daemonsets"}
	unauthorized := apierrors.NewUnauthorized("Unauthorized")
	forbidden := apierrors.NewForbidden(gr, "ambientd", errors.New("RBAC: not allowed"))
	unavailable := apierrors.NewServiceUnavailable("etcd down")
	dsDeleting := func(c *fake.Clientset) error {
		d := ds.DeepCopy()
		d.DeletionTimestamp, d.Finalizers = &now, []string{"foregroundDeletion"}
		_, err := c.AppsV1().DaemonSets("istio-system").Update(context.Background(), d, metav1.UpdateOptions{})
		return err
	}
	dsDeleted := func(c *fake.Clientset) error {
		return c.AppsV1().DaemonSets("istio-system").Delete(context.Background(), "ambientd", metav1.DeleteOptions{})
	}
	cases := []struct {
		name      string
		ns        *corev1.Namespace
		probeErr  error                       // answer to the probe at start
		meanwhile func(*fake.Clientset) error // what the watch sees before shutdown
		err       error                       // answer at shutdown, to every read
		want      bool
		wantError bool
	}{
		{name: "upgrade", ns: ns, want: false},
		{name: "namespace being deleted", ns: deleting, want: true},
		{name: "agent pod force-deleted or ServiceAccount recreated (401), DaemonSet stays", ns: ns, err: unauthorized, want: false},
		{name: "binding deleted (403), DaemonSet stays", ns: ns, err: forbidden, want: false},
		{name: "ServiceAccount deleted (401), then the DaemonSet (foreground)", ns: ns, meanwhile: dsDeleting, err: unauthorized, want: true},
		{name: "binding deleted (403), then the DaemonSet", ns: ns, meanwhile: dsDeleted, err: forbidden, want: true},
		{name: "401 without a first read", ns: ns, probeErr: unauthorized, err: unauthorized, wantError: true},
		{name: "403 without a first read", ns: ns, probeErr: forbidden, err: forbidden, wantError: true},
		{name: "API unavailable", ns: ns, err: unavailable, wantError: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := fake.NewClientset(node, ds, tc.ns)
			var answer atomic.Pointer[error]
			answer.Store(&tc.probeErr)
			c.PrependReactor("get", "*", func(action k8stesting.Action) (bool, runtime.Object, error) {
				if err := *answer.Load(); err != nil {
					return true, nil, err
				}
				return false, nil, nil
			})
			r := New(kubetest.Wrap(c), "istio-system", "ambientd", "n1")
			if err := r.Probe(context.Background()); (err == nil) != (tc.probeErr == nil) {
				t.Fatalf("probe: %v, want error %v", err, tc.probeErr)
			}
			if tc.meanwhile != nil {
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() { defer close(done); _ = r.follow(ctx, "") }()
				before := r.seen.Load()
				testutil.Eventually(t, "the watch is established", 5*time.Second, func() bool {
					// the fake's watch starts delivering once registered
					return len(c.Fake.Actions()) > 0 && hasWatch(c)
				})
				if err := tc.meanwhile(c); err != nil {
					t.Fatal(err)
				}
				testutil.Eventually(t, "the watch saw the change", 5*time.Second, func() bool { return r.seen.Load() != before })
				cancel()
				<-done
			}
			answer.Store(&tc.err)
			got, reason, err := r.Decide(context.Background())
			if tc.wantError {
				if err == nil || got {
					t.Fatalf("uninstall=%v (%q) err=%v, want keep with an error", got, reason, err)
				}
				return
			}
			if err != nil || got != tc.want || reason == "" {
				t.Fatalf("uninstall=%v (%q) err=%v, want %v", got, reason, err, tc.want)
			}
			t.Logf("uninstall=%v: %s", got, reason)
		})
	}
}

func hasWatch(c *fake.Clientset) bool {
	for _, a := range c.Fake.Actions() {
		if a.GetVerb() == "watch" {
			return true
		}
	}
	return false
}
