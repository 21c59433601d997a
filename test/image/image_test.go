//go:build e2e

// Package image tests the agent image `make image` builds: reproducible, and
// runnable by containerd (Debian's, started here with its own root, state and
// socket under a temporary directory, stopped afterwards).
//
//	go test -tags e2e -count=1 -v ./test/image/   (as root; `make image-test`)
package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

const tag = "ghcr.io/ambientd/ambientd:imagetest"

func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// buildImage runs hack/image.sh (what `make image` runs) into out and
// returns the digest it printed.
func buildImage(t *testing.T, ctx context.Context, out string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, "hack/image.sh", out)
	cmd.Dir = repoRoot(t)
	cmd.Env = append(os.Environ(), "IMAGE_TAG="+tag)
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("hack/image.sh: %v\n%s", err, b)
	}
	t.Logf("hack/image.sh:\n%s", b)
	for _, l := range strings.Split(string(b), "\n") {
		if d, ok := strings.CutPrefix(l, "digest "); ok {
			return d
		}
	}
	t.Fatalf("no digest in hack/image.sh output:\n%s", b)
	return ""
}

func fileSHA(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

func TestImage(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "containerd", "ctr", "runc", "podman", "apt-get", "dpkg-deb", "ldconfig")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	dir := t.TempDir()

	// Reproducible: two builds, same digest, same archive bytes.
	a, b := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	da := buildImage(t, ctx, a)
	db := buildImage(t, ctx, b)
	if da != db || fileSHA(t, a) != fileSHA(t, b) {
		t.Fatalf("two builds differ: digests %s / %s, archives %s / %s", da, db, fileSHA(t, a), fileSHA(t, b))
	}
	fi, _ := os.Stat(a)
	t.Logf("image %s digest %s archive %.1f MiB", tag, da, float64(fi.Size())/(1<<20))

	ctr := startContainerd(t, ctx, dir)
	ns := "ambientd-imagetest"
	if out, err := ctr(ns, "images", "import", "--snapshotter", "native", a); err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, out)
	}
	out, err := ctr(ns, "images", "ls")
	if err != nil || !strings.Contains(out, tag) || !strings.Contains(out, da) {
		t.Fatalf("ctr images ls (want %s at %s): %v\n%s", tag, da, err, out)
	}
	wantVersion, err := exec.CommandContext(ctx, "git", "-C", repoRoot(t), "describe", "--always", "--dirty").Output()
	if err != nil {
		t.Fatal(err)
	}
	runs := []struct {
		args []string
		want string
	}{
		{[]string{"ambientd", "version"}, strings.TrimSpace(string(wantVersion))},
		{[]string{"iptables-legacy", "--version"}, "(legacy)"},
		{[]string{"iptables-nft", "--version"}, "(nf_tables)"},
		{[]string{"ip6tables-legacy-restore", "--version"}, "(legacy)"},
		{[]string{"ip6tables-nft-restore", "--version"}, "(nf_tables)"},
		{[]string{"ambientd-cni", "--version"}, "CNI"},
	}
	for i, r := range runs {
		args := append([]string{"run", "--rm", "--snapshotter", "native", tag, fmt.Sprintf("imagetest-%d", i)}, r.args...)
		out, err := ctr(ns, args...)
		if err != nil || !strings.Contains(out, r.want) {
			t.Errorf("ctr run %v: %v\n%s\nwant output containing %q", r.args, err, out, r.want)
		}
	}
	if out, err := ctr(ns, "images", "rm", tag); err != nil {
		t.Errorf("ctr images rm: %v\n%s", err, out)
	}

	// podman load accepts it too (its own storage under dir, vfs driver:
	// no mounts to leave behind).
	pm := filepath.Join(dir, "podman")
	podman := func(args ...string) (string, error) {
		base := []string{"--root", filepath.Join(pm, "root"), "--runroot", filepath.Join(pm, "run"), "--tmpdir", filepath.Join(pm, "tmp"),
			"--storage-driver", "vfs", "--events-backend", "none", "--cgroup-manager", "cgroupfs"}
		b, err := exec.CommandContext(ctx, "podman", append(base, args...)...).CombinedOutput()
		return string(b), err
	}
	if out, err := podman("load", "-i", a); err != nil || !strings.Contains(out, "Loaded image: "+tag) {
		t.Errorf("podman load: %v\n%s", err, out)
	}
	out, err = podman("image", "inspect", "--format", "{{.Id}} {{.Config.Entrypoint}}", tag)
	if err != nil || !strings.Contains(out, "/usr/local/bin/ambientd") {
		t.Errorf("podman image inspect: %v\n%s", err, out)
	}
}

// startContainerd runs containerd with everything under dir (root, state,
// socket; CRI off) and returns a ctr runner; it is stopped at cleanup.
func startContainerd(t *testing.T, ctx context.Context, dir string) func(ns string, args ...string) (string, error) {
	t.Helper()
	sock := filepath.Join(dir, "c.sock")
	cfg := filepath.Join(dir, "config.toml")
	conf := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), sock, filepath.Join(dir, "opt"))
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	var logBuf bytes.Buffer
	cmd := exec.Command("containerd", "--config", cfg, "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = &logBuf, &logBuf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("containerd log:\n%s", logBuf.String())
		}
	})
	run := func(ns string, args ...string) (string, error) {
		c := exec.CommandContext(ctx, "ctr", append([]string{"--address", sock, "--namespace", ns}, args...)...)
		b, err := c.CombinedOutput()
		return string(b), err
	}
	testutil.Eventually(t, "containerd serving on "+sock, time.Minute, func() bool {
		_, err := run("default", "version")
		return err == nil
	})
	return run
}
