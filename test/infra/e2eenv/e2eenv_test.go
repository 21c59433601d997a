package e2eenv

import (
	"context"
	"encoding/base64"
	"encoding/csv"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"golang.org/x/sys/unix"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

func TestTokenFile(t *testing.T) {
	recs, err := csv.NewReader(strings.NewReader(tokenFile("admintok", "agenttok"))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"admintok", AdminUser, "e2e-admin-uid", "system:masters"},
		{"agenttok", "system:serviceaccount:istio-system:ambientd", "e2e-agent-uid", "system:serviceaccounts,system:serviceaccounts:istio-system,system:authenticated"},
	}
	if len(recs) != len(want) {
		t.Fatalf("records %q", recs)
	}
	for i := range want {
		if strings.Join(recs[i], "|") != strings.Join(want[i], "|") {
			t.Errorf("record %d = %q, want %q", i, recs[i], want[i])
		}
	}
}

func TestKubeconfig(t *testing.T) {
	var cfg struct {
		Clusters []struct {
			Name    string
			Cluster struct {
				Server string
				CAData string `json:"certificate-authority-data"`
			}
		}
		Users []struct {
			Name string
			User struct{ Token string }
		}
		CurrentContext string `json:"current-context"`
	}
	ca := []byte("-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n")
	if err := yaml.Unmarshal([]byte(kubeconfig("https://127.0.0.1:6443", ca, "ambientd", "tok")), &cfg); err != nil {
		t.Fatal(err)
	}
	got, _ := base64.StdEncoding.DecodeString(cfg.Clusters[0].Cluster.CAData)
	if cfg.Clusters[0].Cluster.Server != "https://127.0.0.1:6443" || string(got) != string(ca) ||
		cfg.Users[0].Name != "ambientd" || cfg.Users[0].User.Token != "tok" || cfg.CurrentContext != "e2e" {
		t.Fatalf("kubeconfig decoded to %+v", cfg)
	}
}

func TestConflist(t *testing.T) {
	dir := t.TempDir()
	c, err := NewChain(ChainConfig{BinDirs: []string{dir}, Dir: dir, AmbientPlugin: AmbientPluginConf("/run/a.sock", "/tmp/cni.log")})
	if err != nil {
		t.Fatal(err)
	}
	types := func() []string {
		l, err := libcni.NetworkConfFromFile(c.ConflistPath)
		if err != nil {
			t.Fatal(err)
		}
		if l.CNIVersion != CNIVersion || l.Name != "e2e" {
			t.Fatalf("conflist version %q name %q", l.CNIVersion, l.Name)
		}
		var out []string
		for _, p := range l.Plugins {
			out = append(out, p.Network.Type)
			if p.Network.Type == "bridge" && !strings.Contains(string(p.Bytes), c.IPAMDir) {
				t.Errorf("bridge ipam does not keep leases in %s: %s", c.IPAMDir, p.Bytes)
			}
		}
		return out
	}
	if got := strings.Join(types(), ","); got != "bridge,ambientd-cni" {
		t.Fatalf("plugins %s, want bridge then ambientd-cni last", got)
	}
	if err := c.SetAmbientPlugin(nil); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(types(), ","); got != "bridge" {
		t.Fatalf("plugins %s after removing ours", got)
	}
}

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{`/a/b`: "/a/b", `/a\040b`: "/a b", `/x\011`: "/x\t", `/trail\`: `/trail\`} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestApplyRBACManifest checks that deploy/rbac.yaml parses and lands where
// the environment expects (pure parsing; the e2e suite applies it to the real
// apiserver and exercises it).
func TestApplyRBACManifest(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientset()
	ctx := context.Background()
	if err := ApplyManifest(ctx, c, filepath.Join(root, "deploy", "rbac.yaml"), AgentNamespace); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CoreV1().ServiceAccounts(AgentNamespace).Get(ctx, AgentServiceAccount, metav1.GetOptions{}); err != nil {
		t.Fatalf("service account: %v", err)
	}
	crb, err := c.RbacV1().ClusterRoleBindings().Get(ctx, "ambientd", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s := crb.Subjects[0]; s.Kind != rbacv1.ServiceAccountKind || s.Namespace != AgentNamespace || s.Name != AgentServiceAccount {
		t.Fatalf("binding subject %+v", s)
	}
	// Applying again updates instead of failing.
	if err := ApplyManifest(ctx, c, filepath.Join(root, "deploy", "rbac.yaml"), AgentNamespace); err != nil {
		t.Fatalf("second apply: %v", err)
	}
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n"), 0o644)
	if err := ApplyManifest(ctx, c, bad, "default"); err == nil || !strings.Contains(err.Error(), "not supported") {
		t.Fatalf("unsupported kind: %v", err)
	}
}

func TestProcessLifecycle(t *testing.T) {
	sp := newSpawner()
	defer sp.close()
	dir := t.TempDir()
	p := newProcess(sp, "sleeper", "/bin/sh", filepath.Join(dir, "log"), "-c", `echo started $$; trap "echo term; exit 0" TERM; while :; do sleep 0.05; done`)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	if err := p.Start(); err == nil {
		t.Fatal("second Start while running succeeded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.WaitUntil(ctx, "output", 20*time.Millisecond, func(context.Context) (bool, error) {
		return strings.Contains(p.Logs(), "started"), nil
	}); err != nil {
		t.Fatal(err)
	}
	pid := p.Pid()
	if err := p.Restart(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if syscall.Kill(pid, 0) == nil {
		t.Fatalf("old pid %d alive after restart", pid)
	}
	if !strings.Contains(p.Logs(), "term") || strings.Count(p.Logs(), "===== sleeper start") != 2 {
		t.Fatalf("log after restart:\n%s", p.Logs())
	}
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	if p.Running() || p.ExitError() == nil {
		t.Fatalf("after Kill: running=%v exit=%v", p.Running(), p.ExitError())
	}
	if err := p.Stop(time.Second); err != nil {
		t.Fatalf("Stop of a stopped process: %v", err)
	}

	// A process that exits on its own is reported by waitUntil.
	q := newProcess(sp, "failer", "/bin/sh", filepath.Join(dir, "log2"), "-c", "echo boom >&2; exit 3")
	if err := q.Start(); err != nil {
		t.Fatal(err)
	}
	err := q.WaitUntil(ctx, "never", 20*time.Millisecond, func(context.Context) (bool, error) { return false, nil })
	if err == nil || !strings.Contains(err.Error(), "exited") || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("waitUntil on exiting process: %v", err)
	}
}

// A netns created for a pod must never move the test process itself: Go
// wedges (does not discard) a main thread whose goroutine ends locked, so an
// unshare there would change /proc/self/ns/net for everything after it.
func TestNamespaceChangeNeverOnMainThread(t *testing.T) {
	testutil.RequireRoot(t)
	if mainThreadResult != nil {
		t.Fatal(mainThreadResult)
	}
}

func TestNetnsCreateDelete(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	// Runs before TempDir's removal (cleanups run last-in first-out), so a
	// failure below does not also leave a busy mount behind.
	t.Cleanup(func() {
		if err := UnmountUnder(dir); err != nil {
			t.Error(err)
		}
	})
	n, err := NewNetns(dir, "pod1")
	if err != nil {
		t.Fatal(err)
	}
	var self, pod unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &self); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(n.Path(), &pod); err != nil {
		t.Fatal(err)
	}
	if self.Ino == pod.Ino {
		t.Fatal("new netns is the test's own")
	}
	if _, err := NewNetns(dir, "pod1"); err == nil {
		t.Fatal("second netns with the same name succeeded")
	}
	if err := DeleteNetns(n); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "pod1")); !os.IsNotExist(err) {
		t.Fatalf("mount point still there: %v", err)
	}
}
