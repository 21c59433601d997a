package cniinstall

import (
	"errors"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// results collects what an Installer reports to Observe.
type results struct {
	mu  sync.Mutex
	got []Result
}

func (r *results) add(x Result) { r.mu.Lock(); r.got = append(r.got, x); r.mu.Unlock() }

func (r *results) count(x Result) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, g := range r.got {
		if g == x {
			n++
		}
	}
	return n
}

func (r *results) snapshot() []Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// TestObserveRounds: a round that cannot write the CNI config reports
// ConfigFailed (each retry again), the round that then installs reports
// Installed, and a repair of another's rewrite reports Installed again.
func TestObserveRounds(t *testing.T) {
	h := newHostTree(t)
	if err := os.RemoveAll(h.conf); err != nil {
		t.Fatal(err)
	}
	writeFile(t, h.conf, "not a directory", 0o644)
	i := h.installer(t, inPlace)
	var r results
	i.Observe(r.add)
	runInstaller(t, i)
	testutil.Eventually(t, "a failed round reported", 10*time.Second, func() bool { return r.count(ConfigFailed) >= 1 })
	if n := r.count(Installed); n != 0 {
		t.Fatalf("%d rounds reported Installed while the conf dir is a file", n)
	}

	if err := os.Remove(h.conf); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(h.conf, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	testutil.Eventually(t, "the install reported", 45*time.Second, func() bool { return r.count(Installed) == 1 })
	waitInstalled(t, i, "installed")

	// The primary rewrites its file, dropping our entry: repaired.
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	testutil.Eventually(t, "the repair reported", 10*time.Second, func() bool { return r.count(Installed) == 2 })
	if got := r.snapshot(); slices.Contains(got, BinaryFailed) || slices.Contains(got, KubeconfigFailed) {
		t.Errorf("reported %v: no binary or kubeconfig failure happened", got)
	}
}

// TestObserveBinaryAndKubeconfigFailures: a plugin binary that cannot be
// read fails the round as BinaryFailed; credentials that cannot be had
// fail the kubeconfig write as KubeconfigFailed.
func TestObserveBinaryAndKubeconfigFailures(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	if err := os.Remove(h.src); err != nil {
		t.Fatal(err)
	}
	i := h.installer(t, inPlace, func(c *Config) {
		c.Credentials = func() ([]byte, error) { return nil, errors.New("token request refused") }
	})
	var r results
	i.Observe(r.add)
	if err := i.WriteLease(); err == nil {
		t.Fatal("WriteLease with no credentials succeeded")
	}
	if got := r.snapshot(); !slices.Equal(got, []Result{KubeconfigFailed}) {
		t.Fatalf("after the failed kubeconfig write: %v, want [KubeconfigFailed]", got)
	}
	runInstaller(t, i)
	testutil.Eventually(t, "the failed binary copy reported", 10*time.Second, func() bool { return r.count(BinaryFailed) >= 1 })
	if n := r.count(ConfigFailed) + r.count(Installed); n != 0 {
		t.Errorf("%d config or install reports although the binary step failed first", n)
	}
}
