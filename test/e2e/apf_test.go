//go:build e2e

package e2e

import (
	"context"
	"net/http"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// TestAgentRequestsHaveTheirOwnPriorityLevel: with the shipped FlowSchema
// and PriorityLevelConfiguration (deploy/apf.yaml) applied to the real
// kube-apiserver, the agent's requests are classified into them — as the
// apiserver's API Priority and Fairness headers on its answers say — so a
// storm of agents queues at its own level (docs/scale.md).
func TestAgentRequestsHaveTheirOwnPriorityLevel(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	dyn, mapper := dynamicClient(t, testEnv.CP.AdminConfig)
	var applied []*unstructured.Unstructured
	for _, o := range renderDeploy(t) {
		if k := o.GetKind(); k != "FlowSchema" && k != "PriorityLevelConfiguration" {
			continue
		}
		o.SetNamespace("") // cluster-scoped (kustomize's schema does not know it)
		if err := serverSideApply(ctx, dyn, mapper, o, false); err != nil {
			t.Fatalf("apply %s %s: %v", o.GetKind(), o.GetName(), err)
		}
		applied = append(applied, o)
		t.Cleanup(func() {
			if err := deleteObject(context.Background(), dyn, mapper, o); err != nil {
				t.Errorf("delete %s %s: %v", o.GetKind(), o.GetName(), err)
			}
		})
	}
	if len(applied) != 2 {
		t.Fatalf("deploy/ holds %d APF objects, want a FlowSchema and a PriorityLevelConfiguration", len(applied))
	}
	uid := map[string]string{}
	for _, o := range applied {
		m, err := mapper.RESTMapping(o.GroupVersionKind().GroupKind(), o.GroupVersionKind().Version)
		if err != nil {
			t.Fatal(err)
		}
		got, err := dyn.Resource(m.Resource).Get(ctx, o.GetName(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		uid[o.GetKind()] = string(got.GetUID())
	}

	// A request as the agent (its service account's token), read raw for
	// the classification headers.
	hc, err := rest.HTTPClientFor(testEnv.CP.AgentConfig)
	if err != nil {
		t.Fatal(err)
	}
	var fs, pl string
	testutil.Until(t, ctx, "the agent's request classified into the ambientd FlowSchema", func() bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, testEnv.CP.URL+"/api/v1/nodes/"+testEnv.NodeName, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := hc.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		fs, pl = resp.Header.Get("X-Kubernetes-PF-FlowSchema-UID"), resp.Header.Get("X-Kubernetes-PF-PriorityLevel-UID")
		return resp.StatusCode == http.StatusOK && fs == uid["FlowSchema"]
	})
	if pl != uid["PriorityLevelConfiguration"] {
		t.Errorf("priority level %q, want ambientd's %q", pl, uid["PriorityLevelConfiguration"])
	}
	t.Logf("the agent's GET of its Node: FlowSchema %s, priority level %s (both ambientd's)", fs, pl)
}
