//go:build e2e

package e2e

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
)

// golden returns the pod Istio's injector produced for a golden case.
func golden(t *testing.T, name string) istiogolden.Case {
	t.Helper()
	c, err := istiogolden.LoadCase(name)
	if err != nil {
		t.Fatal(err)
	}
	if c.Injected == nil {
		t.Fatalf("%s: no injected pod", name)
	}
	return c
}

// injected makes a PodSpec of a golden injected pod (its labels,
// annotations and containers) in namespace ns.
func injected(c istiogolden.Case, ns, name string) e2eenv.PodSpec {
	return e2eenv.InjectedPodSpec(c.Injected, ns, name)
}

// validate runs our istio-validation (bin/sidecar-validation) in the pod's
// namespace as the proxy's uid, with the injected container's args (a pod
// without one, e.g. a gateway: the default pod's), and returns its exit
// code.
func validate(t *testing.T, p *e2eenv.Pod, c istiogolden.Case) (int, string) {
	t.Helper()
	var args []string
	for _, cc := range []istiogolden.Case{c, golden(t, "redirect-default")} {
		for _, ct := range cc.Injected.Spec.InitContainers {
			if ct.Name == "istio-validation" && args == nil {
				args = ct.Args
			}
		}
	}
	var out []byte
	code := -1
	err := p.Do(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, testEnv.Bins.Validation, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1337, Gid: 1337}}
		var err error
		out, err = cmd.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code, err = ee.ExitCode(), nil
		} else if err == nil {
			code = 0
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return code, string(out)
}

// TestSidecarPodThroughTheChain: a pod as Istio's injector injects it in
// CNI mode, created through the real CNI chain with our plugin, is captured
// for its proxy at CNI ADD — istio-validation (ours, as the injected
// container runs it) passes in its sandbox — and is never sent to ztunnel,
// annotated or given the enrolled condition, in an ambient namespace too.
// Istio's skip cases start with no rules (validation fails with 126); an
// invalid sidecar annotation fails the ADD with Istio's error and an Event.
func TestSidecarPodThroughTheChain(t *testing.T) {
	s := newScenario(t, "sidecar-amb", within(6*time.Minute))
	ctx, ambient, em, a := s.ctx, s.ns, s.em, s.agent
	plain := uniqueNS("sidecar")
	createNamespace(t, ctx, plain, false)

	for _, tc := range []struct{ ns, golden string }{{plain, "redirect-default"}, {ambient, "dns-capture"}, {plain, "tproxy"}} {
		c := golden(t, tc.golden)
		p := createPod(t, ctx, injected(c, tc.ns, tc.golden))
		if code, out := validate(t, p, c); code != 0 {
			t.Errorf("%s/%s: validation exit %d, want 0: %s", tc.ns, tc.golden, code, out)
		}
		o, err := testEnv.CP.Admin.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := o.Annotations[annRedirect]; ok {
			t.Errorf("%s: sidecar pod annotated %s", p.Name, annRedirect)
		}
		for _, cond := range o.Status.Conditions {
			if cond.Type == "ambient.istio.io/enrolled" {
				t.Errorf("%s: sidecar pod given the enrolled condition", p.Name)
			}
		}
		if n := countOps(emuState(t, ctx, em), "add", p.UID); n != 0 {
			t.Errorf("%s: sent to ztunnel %d times", p.Name, n)
		}
	}
	metrics, err := a.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`ambientd_cni_add_total{outcome="sidecar"} 3`, `ambientd_sidecar_adds_total{result="captured"} 3`, "ambientd_sidecar_pods 3"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	// Istio's skip cases: success, nothing programmed.
	for _, name := range []string{"skip-istio-init", "skip-no-istio-proxy", "skip-gateway", "skip-inject-annotation-false", "skip-inject-label-false", "skip-no-status", "skip-disable-envoy"} {
		c := golden(t, name)
		p := createPod(t, ctx, injected(c, plain, name))
		if code, out := validate(t, p, c); code != 126 {
			t.Errorf("%s: validation exit %d, want 126 (no rules): %s", name, code, out)
		}
	}
	if metrics, err = a.Metrics(ctx); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(metrics, "ambientd_sidecar_pods 3\n") || !strings.Contains(metrics, `ambientd_sidecar_adds_total{result="captured"} 3`) {
		t.Errorf("after the skip cases the agent tracks other than the 3 captured pods:\n%s", grepLines(metrics, "ambientd_sidecar"))
	}

	// An invalid annotation (edited after admission): the ADD fails with
	// Istio's error, the pod never starts, an Event says why.
	bad := golden(t, "error-port-out-of-range")
	_, err = testEnv.CreatePod(ctx, injected(bad, plain, "bad-ports"))
	if err == nil || !strings.Contains(err.Error(), "includeInboundPorts") || !strings.Contains(err.Error(), "70000") {
		t.Fatalf("ADD of a pod with an invalid annotation: %v, want an error naming it", err)
	}
	waitPodEvent(t, ctx, plain, "bad-ports", "SidecarCaptureFailed")
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// waitPodEvent waits for an Event with reason about pod namespace/name.
func waitPodEvent(t *testing.T, ctx context.Context, namespace, name, reason string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		evs, err := testEnv.CP.Admin.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
		if err == nil {
			for _, e := range evs.Items {
				if e.Reason == reason {
					return
				}
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("no Event %s on %s/%s", reason, namespace, name)
}
