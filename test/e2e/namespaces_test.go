//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// manyNamespaces is how many namespaces TestManyNamespaces makes: 10,000
// (AMBIENTD_E2E_NAMESPACES for a quick local run).
func manyNamespaces(t *testing.T) int {
	if v := os.Getenv("AMBIENTD_E2E_NAMESPACES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("AMBIENTD_E2E_NAMESPACES=%q: want a positive count", v)
		}
		return n
	}
	return 10000
}

// parallel runs f(i) for i in [0, n) on 16 goroutines; the first error
// fails the test.
func parallel(t *testing.T, n int, f func(i int) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	next := make(chan int)
	for range 16 {
		wg.Go(func() {
			for i := range next {
				if err := f(i); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
}

// rssKiB is a process's resident set (VmRSS).
func rssKiB(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			return n
		}
	}
	t.Fatalf("no VmRSS for pid %d", pid)
	return 0
}

// TestManyNamespaces: every agent holds every namespace (the policy reads
// their labels), so at 10,000 namespaces what it lists and keeps is
// measured — bytes read for namespaces (one streaming list), the agent's
// RSS — and enrollment still follows a namespace's label being added and
// removed, for a namespace among them all.
func TestManyNamespaces(t *testing.T) {
	n := manyNamespaces(t)
	ctx := testutil.Context(t, 15*time.Minute)
	admin := testEnv.CP.Admin
	prefix := uniqueNS("many")
	// Each carries what kubectl apply leaves on it: its last applied
	// configuration (about 1 KiB) and a few labels.
	lastApplied := `{"apiVersion":"v1","kind":"Namespace","metadata":{"annotations":{"owner":"team-` + strings.Repeat("x", 900) + `"},"labels":{"team":"x","env":"prod"},"name":"NAME"}}`
	start := time.Now()
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		parallel(t, n, func(i int) error {
			err := admin.CoreV1().Namespaces().Delete(cctx, fmt.Sprintf("%s-%d", prefix, i), metav1.DeleteOptions{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			return err
		})
	})
	parallel(t, n, func(i int) error {
		name := fmt.Sprintf("%s-%d", prefix, i)
		ns, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels:      map[string]string{"team": "x", "env": "prod"},
			Annotations: map[string]string{"kubectl.kubernetes.io/last-applied-configuration": strings.Replace(lastApplied, "NAME", name, 1)},
		}}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		// No namespace controller runs here to finalize a deleted
		// namespace: without the finalizer the cleanup's delete is final.
		ns.Spec.Finalizers = nil
		_, err = admin.CoreV1().Namespaces().Finalize(ctx, ns, metav1.UpdateOptions{})
		return err
	})
	t.Logf("%d namespaces created in %v", n, time.Since(start).Round(time.Second))

	s := newScenario(t, "manyns", within(15*time.Minute))
	a := s.agent
	read := metricValue(t, ctx, a, "ambientd_kube_response_bytes_total", `resource="namespaces",verb="watch"`) +
		metricValue(t, ctx, a, "ambientd_kube_response_bytes_total", `resource="namespaces",verb="list"`)
	rss := rssKiB(t, a.Pid())
	t.Logf("with %d namespaces: the agent read %.1f MiB for namespaces (%.0f bytes each), its RSS is %.1f MiB",
		n, read/(1<<20), read/float64(n), float64(rss)/1024)
	if read < float64(n)*100 {
		t.Errorf("the agent read %.0f bytes for %d namespaces: it did not list them (the measure is not working)", read, n)
	}

	// Enrollment follows a label on one of them, added and removed.
	target := fmt.Sprintf("%s-%d", prefix, n/2)
	p := createPod(t, ctx, e2eenv.PodSpec{Namespace: target, Name: "web"})
	setNamespaceMode(t, ctx, target, "ambient")
	waitAnnotation(t, ctx, p, "enabled")
	setNamespaceMode(t, ctx, target, "")
	waitNoAnnotation(t, ctx, p)
}
