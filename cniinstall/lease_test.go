package cniinstall

import (
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

func readLeaseFile(t *testing.T, path string) cniapi.InstallLease {
	t.Helper()
	var l cniapi.InstallLease
	if err := json.Unmarshal([]byte(readFile(t, path)), &l); err != nil {
		t.Fatalf("lease %s: %v", path, err)
	}
	return l
}

// The install lease through an installation's life: written at start (in
// state installed, naming the host's conf dir), renewed, marked
// uninstalling, and removed by the uninstall with the binary — never
// written again after that.
func TestInstallLeaseLifecycle(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-calico.conflist"), `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"calico"}]}`, 0o644)
	i := h.installer(t, func(c *Config) { c.HostConfDir, c.LeaseTTL = "/etc/cni/net.d", 3*time.Minute })
	lease := LeasePath(h.bin, "ambientd-cni")
	if err := i.WriteLease(); err != nil {
		t.Fatal(err)
	}
	l := readLeaseFile(t, lease)
	if l.Version != cniapi.LeaseVersion || l.State != cniapi.LeaseInstalled || l.TTL != "3m0s" || l.ConfDir != "/etc/cni/net.d" || l.OwnedName != DefaultOwnedName || l.InPlace || time.Since(l.Renewed) > time.Minute {
		t.Fatalf("lease at start: %+v", l)
	}
	if fi, err := os.Stat(lease); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("lease mode: %v %v, want 0644", fi.Mode(), err)
	}
	if got := i.Config().LeaseRenewal(); got != 36*time.Second {
		t.Errorf("renewal period for a 3m TTL: %v, want 36s (a fifth)", got)
	}
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	first := l.Renewed
	if err := i.WriteLease(); err != nil {
		t.Fatal(err)
	}
	if l = readLeaseFile(t, lease); !l.Renewed.After(first) || l.State != cniapi.LeaseInstalled {
		t.Fatalf("renewed lease: %+v (first %v)", l, first)
	}
	if err := i.MarkUninstalling(); err != nil {
		t.Fatal(err)
	}
	if l = readLeaseFile(t, lease); l.State != cniapi.LeaseUninstalling {
		t.Fatalf("marked lease: %+v", l)
	}
	if err := i.WriteLease(); err != nil { // a renewal after the decision keeps the state
		t.Fatal(err)
	}
	if l = readLeaseFile(t, lease); l.State != cniapi.LeaseUninstalling {
		t.Fatalf("renewed after the decision: %+v", l)
	}
	if err := i.Uninstall(); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{lease, filepath.Join(h.bin, "ambientd-cni"), h.path(DefaultOwnedName)} {
		if exists(p) {
			t.Errorf("%s left after the uninstall", p)
		}
	}
	if err := i.WriteLease(); err != nil || exists(lease) {
		t.Errorf("a renewal after the uninstall wrote the lease again (%v)", err)
	}
}

// FinishUninstall (the plugin's recovery, from the lease) removes what the
// agent would have; when the conf dir the lease names is not there, it
// keeps the binary and the lease: a config naming a missing plugin would
// fail every ADD.
func TestFinishUninstallFromLease(t *testing.T) {
	for _, mode := range []string{"owned", "in-place"} {
		t.Run(mode, func(t *testing.T) {
			h := newHostTree(t)
			primary := "{\n  \"cniVersion\": \"1.0.0\",\n  \"name\": \"k8s\",\n  \"plugins\": [\n    {\"type\": \"calico\"}\n  ]\n}\n"
			writeFile(t, h.path("10-calico.conflist"), primary, 0o644)
			var mut []func(*Config)
			if mode == "in-place" {
				mut = append(mut, inPlace)
			}
			i := h.installer(t, mut...)
			if _, err := i.Install(); err != nil {
				t.Fatal(err)
			}
			if err := i.MarkUninstalling(); err != nil {
				t.Fatal(err)
			}
			l := readLeaseFile(t, LeasePath(h.bin, "ambientd-cni"))
			plugin := filepath.Join(h.bin, "ambientd-cni")

			bad := l
			bad.ConfDir = filepath.Join(h.root, "no/such/dir")
			r, err := FromLease(bad, plugin, testutil.Logger(t, slog.LevelDebug))
			if err != nil {
				t.Fatal(err)
			}
			if err := r.FinishUninstall(); err == nil || !strings.Contains(err.Error(), "not a directory") {
				t.Fatalf("conf dir missing: %v, want an error", err)
			}
			if !exists(plugin) || !exists(LeasePath(h.bin, "ambientd-cni")) {
				t.Fatal("the binary or lease went although the conf dir could not be cleaned")
			}

			r, err = FromLease(l, plugin, testutil.Logger(t, slog.LevelDebug))
			if err != nil {
				t.Fatal(err)
			}
			if err := r.FinishUninstall(); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, h.path("10-calico.conflist")); got != primary {
				t.Errorf("primary after the recovery:\n%s\nwant\n%s", got, primary)
			}
			entries, _ := os.ReadDir(h.conf)
			bins, _ := os.ReadDir(h.bin)
			if len(entries) != 1 || len(bins) != 0 {
				t.Errorf("left: conf dir %v, bin dir %v", entries, bins)
			}
		})
	}
}

// FinishUninstall keeps the binary when the conf dir the lease names has no
// config naming the plugin: the runtime that ran it reads another conf dir
// (a host conf dir set wrong), whose config would then fail every ADD.
func TestFinishUninstallKeepsTheBinaryForAnotherConfDir(t *testing.T) {
	root := t.TempDir()
	bin, conf := filepath.Join(root, "bin"), filepath.Join(root, "net.d")
	for _, d := range []string{bin, conf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	plugin := filepath.Join(bin, cniapi.PluginType)
	if err := os.WriteFile(plugin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// The lease's conf dir holds only the primary's config, without us.
	if err := os.WriteFile(filepath.Join(conf, "10-bridge.conflist"), []byte(`{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	inst, err := FromLease(cniapi.InstallLease{Version: cniapi.LeaseVersion, State: cniapi.LeaseUninstalling, TTL: "10m", ConfDir: conf, InPlace: true}, plugin, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.FinishUninstall(); err == nil || !strings.Contains(err.Error(), "reads another conf dir") {
		t.Fatalf("FinishUninstall: %v, want it to refuse", err)
	}
	if _, err := os.Stat(plugin); err != nil {
		t.Fatalf("the binary was removed: %v", err)
	}
}

// A lease that cannot be written is reported (readiness says so) until a
// write works again.
func TestLeaseErrUntilWritten(t *testing.T) {
	root := t.TempDir()
	bin, conf := filepath.Join(root, "bin"), filepath.Join(root, "net.d")
	src := filepath.Join(root, "src")
	if err := os.WriteFile(src, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	inst, err := New(Config{BinSource: src, BinDir: bin, ConfDir: conf}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.LeaseErr(); err != nil {
		t.Fatalf("before any write: %v", err)
	}
	// Something that cannot be replaced by a file where the lease goes
	// (root ignores file modes: a read-only dir would not stop it).
	block := filepath.Join(LeasePath(bin, cniapi.PluginType), "x")
	if err := os.MkdirAll(block, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := inst.WriteLease(); err == nil || inst.LeaseErr() == nil {
		t.Fatalf("lease write over a directory: %v, LeaseErr %v", err, inst.LeaseErr())
	}
	if err := os.RemoveAll(LeasePath(bin, cniapi.PluginType)); err != nil {
		t.Fatal(err)
	}
	if err := inst.WriteLease(); err != nil || inst.LeaseErr() != nil {
		t.Fatalf("lease write once possible again: %v, LeaseErr %v", err, inst.LeaseErr())
	}
}

// The first lease write on a node whose CNI bin dir does not exist yet
// writes the plugin's kubeconfig too: the plugin can read the API while no
// agent answers from the agent's first start on.
func TestFirstLeaseWritesTheKubeconfigIntoANewBinDir(t *testing.T) {
	root := t.TempDir()
	bin, conf := filepath.Join(root, "opt/cni/bin"), filepath.Join(root, "net.d")
	src := filepath.Join(root, "src")
	if err := os.WriteFile(src, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	inst, err := New(Config{BinSource: src, BinDir: bin, ConfDir: conf,
		Credentials: func() ([]byte, error) { return []byte("apiVersion: v1\nkind: Config\n"), nil }}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.WriteLease(); err != nil {
		t.Fatalf("first lease write: %v", err)
	}
	for _, p := range []string{LeasePath(bin, cniapi.PluginType), filepath.Join(bin, cniapi.PluginType+cniapi.KubeconfigSuffix)} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("after the first lease write: %v", err)
		}
	}
}
