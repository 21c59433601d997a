//go:build istiooracle

// The oracle check (make istio-oracle-check): Istio's own istio-validation,
// built from the pinned Istio release by make istio-oracle, judges the same
// namespaces as ours. Not in make test: it needs that build.

package sidecar_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/validation"
)

// istioValidation is bin/istio-validation (ISTIO_VALIDATION overrides),
// copied where the proxy's uid may run it. Missing: the test fails.
func istioValidation(t *testing.T) string {
	t.Helper()
	p := os.Getenv("ISTIO_VALIDATION")
	if p == "" {
		_, file, _, _ := runtime.Caller(0)
		p = filepath.Join(filepath.Dir(file), "..", "..", "bin", "istio-validation")
	}
	in, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("Istio's validation binary (make istio-oracle builds it): %v", err)
	}
	dir, err := os.MkdirTemp("", "istio-validation-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "istio-validation")
	if err := os.WriteFile(out, in, 0o755); err != nil {
		t.Fatal(err)
	}
	return out
}

// runIstio runs Istio's validation in n as uid:gid with args.
func runIstio(t *testing.T, bin string, n ns.NetNS, uid, gid uint32, args []string) (int, string) {
	t.Helper()
	var code int
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
		var err error
		out, err = cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			code, err = ee.ExitCode(), nil
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return code, string(out)
}

// validationUser is the istio-validation container's uid and gid.
func validationUser(t *testing.T, c istiogolden.Case) (uint32, uint32) {
	for _, ct := range c.Injected.Spec.InitContainers {
		if ct.Name == "istio-validation" && ct.SecurityContext != nil && ct.SecurityContext.RunAsUser != nil {
			gid := *ct.SecurityContext.RunAsUser
			if ct.SecurityContext.RunAsGroup != nil {
				gid = *ct.SecurityContext.RunAsGroup
			}
			return uint32(*ct.SecurityContext.RunAsUser), uint32(gid)
		}
	}
	return 1337, 1337
}

// TestIstioValidationAgrees: Istio's istio-validation and ours give the
// same verdict (exit code) on the same namespaces, each run as the injected
// container runs (its uid/gid and args): pods programmed by our Manager on
// every backend (pass), the same pods without rules (126), with our
// IN_REDIRECT chain emptied behind our back (126), with Istio's own golden
// rules (pass), and a namespace with no usable address (1: neither can
// tell the family).
func TestIstioValidationAgrees(t *testing.T) {
	testutil.RequireIptables(t, "nft")
	bin := istioValidation(t)
	ctx := testCtx(t)
	check := func(t *testing.T, n ns.NetNS, c istiogolden.Case, want int) {
		t.Helper()
		uid, gid := validationUser(t, c)
		args := validationArgs(t, c)
		icode, iout := runIstio(t, bin, n, uid, gid, args)
		ocode, oout := runAs(t, n, uid, gid, "validate", args...)
		if icode != want || ocode != want {
			t.Errorf("exit codes: Istio's %d, ours %d, want %d\nIstio's output:\n%s\nours:\n%s", icode, ocode, want, lastLines(iout), oout)
		}
	}
	for _, name := range []string{"redirect-default", "custom-uid-gid", "dns-capture", "tproxy", "ipv6", "dualstack", "tproxy-dualstack", "exclude-interfaces", "inbound-ports-include"} {
		c, err := istiogolden.LoadCase(name)
		if err != nil {
			t.Fatal(err)
		}
		p, err := sidecar.Parse(c.Injected, c.IPs())
		if err != nil {
			t.Fatal(err)
		}
		t.Run(name+"/no-rules", func(t *testing.T) {
			pod := podWithAddrs(t, c)
			check(t, pod, c, validation.ExitFailed)
		})
		for _, mode := range allModes {
			m := newManager(t, mode)
			t.Run(name+"/ours-"+string(mode), func(t *testing.T) {
				pod := podWithAddrs(t, c)
				if err := m.ApplySidecar(ctx, pod, p.Options, nil); err != nil {
					t.Fatal(err)
				}
				check(t, pod, c, validation.ExitOK)
			})
		}
		t.Run(name+"/istio-golden", func(t *testing.T) {
			pod := podWithAddrs(t, c)
			loadIstio(t, pod, c, iptables.ModeNFT)
			check(t, pod, c, validation.ExitOK)
		})
	}
	c, err := istiogolden.LoadCase("redirect-default")
	if err != nil {
		t.Fatal(err)
	}
	p, err := sidecar.Parse(c.Injected, c.IPs())
	if err != nil {
		t.Fatal(err)
	}
	t.Run("in-redirect-flushed", func(t *testing.T) {
		m := newManager(t, iptables.ModeLegacy)
		pod := podWithAddrs(t, c)
		if err := m.ApplySidecar(ctx, pod, p.Options, nil); err != nil {
			t.Fatal(err)
		}
		nsRun(t, pod, "", "iptables-legacy", "-t", "nat", "-F", "ISTIO_IN_REDIRECT")
		check(t, pod, c, validation.ExitFailed)
	})
	t.Run("no-address", func(t *testing.T) {
		m := newManager(t, iptables.ModeNFTables)
		pod := testutil.NewNetNS(t).NS
		if err := m.ApplySidecar(ctx, pod, p.Options, nil); err != nil {
			t.Fatal(err)
		}
		check(t, pod, c, validation.ExitUsage)
	})
}

func lastLines(s string) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > 6 {
		l = l[len(l)-6:]
	}
	return strings.Join(l, "\n")
}
