package agent

import (
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ambientd/ambientd/policy"
)

// TestRuntimeClassDecidesCapture: the CNI ADD of a mesh pod is decided by
// the handler of the RuntimeClass it names: runc is enrolled; runsc (whose
// traffic the rules would not see), a RuntimeClass that does not exist,
// and one the API cannot be asked about are refused with nothing
// programmed, nothing told to ztunnel and nothing annotated — the first two
// as an invalid pod with condition False/RuntimeNotCapturable and an Event,
// the last as an API outage the runtime retries.
func TestRuntimeClassDecidesCapture(t *testing.T) {
	rc := func(name, handler string) *nodev1.RuntimeClass {
		return &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Handler: handler}
	}
	flaky := withReactor("get", "runtimeclasses", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.GetAction).GetName() == "flaky" {
			return true, nil, errors.New("etcdserver: request timed out")
		}
		return false, nil, nil
	})
	h := newHarness(t, withObjects(namespace("app", true), rc("standard", "runc"), rc("gvisor", "runsc")), flaky)
	h.zt.connect()
	under := func(name, class string) *corev1.Pod {
		p := pod("app", name, "uid-"+name, nil)
		p.Spec.RuntimeClassName = &class
		if _, err := h.client.CoreV1().Pods("app").Create(t.Context(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		return p
	}

	if out, err := h.cni.HandleAdd(t.Context(), h.event(under("runc", "standard"))); err != nil || out != Enrolled {
		t.Fatalf("runc pod: %v, %v; want enrolled", out, err)
	}
	for _, c := range []struct {
		pod, class string
		want       error
		says       string
		shows      bool // condition False/RuntimeNotCapturable and an Event
	}{
		{"gvisor", "gvisor", ErrInvalidPod, `handler "runsc"`, true},
		{"gone", "missing", ErrInvalidPod, `RuntimeClass "missing" does not exist`, true},
		{"flaky", "flaky", ErrAPIUnavailable, "request timed out", false},
	} {
		p := under(c.pod, c.class)
		_, err := h.cni.HandleAdd(t.Context(), h.event(p))
		var ue *policy.UncapturableRuntimeError
		if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) || (c.want == ErrInvalidPod) != errors.As(err, &ue) {
			t.Errorf("%s: %v, want %v saying %q", c.pod, err, c.want, c.says)
		}
		if c.shows {
			h.waitFor(c.pod+" condition False/"+ReasonRuntimeNotCapturable, func() bool {
				cond := h.condition("app", c.pod)
				return cond != nil && cond.Status == corev1.ConditionFalse && cond.Reason == ReasonRuntimeNotCapturable && strings.Contains(cond.Message, c.says)
			})
			h.waitFor(c.pod+" Event", func() bool { return h.hasEvent("app", EventRuntimeNotCapturable, c.says) })
		}
		if v, ok := h.annotation("app", c.pod); ok {
			t.Errorf("%s annotated %q", c.pod, v)
		}
		if n := h.zt.tried(string(p.UID)); n != 0 {
			t.Errorf("%s: ztunnel asked to add it %d times", c.pod, n)
		}
	}
	if n := h.failures("invalid_pod"); n != 2 {
		t.Errorf("failures{reason=invalid_pod} = %v, want 2 (the refused ADDs)", n)
	}
	if applied, _, _ := h.rules.counts(); applied != 1 || h.reg.Len() != 1 {
		t.Errorf("rules applied %d times, registry holds %d pods; want only the runc pod's", applied, h.reg.Len())
	}
}
