package nodeenv

import (
	"archive/tar"
	"bufio"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

func TestParseCgroupMounts(t *testing.T) {
	mountinfo := `23 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:5 - cgroup cgroup rw,cpu,cpuacct
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
`
	got, err := parseCgroupMounts(bufio.NewScanner(strings.NewReader(mountinfo)))
	if err != nil {
		t.Fatal(err)
	}
	want := []cgroupMount{
		{"/sys/fs/cgroup/cpu", "cgroup", "cpu"},
		{"/sys/fs/cgroup/cpu,cpuacct", "cgroup", "cpu,cpuacct"},
		{"/sys/fs/cgroup/systemd", "cgroup", "none,name=systemd"},
		{"/sys/fs/cgroup/unified", "cgroup2", "nsdelegate"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("mount %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	if _, err := parseCgroupMounts(bufio.NewScanner(strings.NewReader("23 1 0:21 / /sys rw - sysfs sysfs rw\n"))); err == nil {
		t.Error("no cgroup mounts: want an error")
	}
}

// The node's conflist is what libcni (and so containerd's CRI) loads: the
// bridge plugin with host-local leases in our dir.
func TestNodeConflistLoads(t *testing.T) {
	b, err := nodeConflist("ambnode0", "10.244.0.0/24", "/tmp/x/ipam")
	if err != nil {
		t.Fatal(err)
	}
	l, err := libcni.ConfListFromBytes(b)
	if err != nil {
		t.Fatalf("libcni rejects the conflist: %v\n%s", err, b)
	}
	if l.Name != "ambientd-node" || len(l.Plugins) != 1 || l.Plugins[0].Network.Type != "bridge" {
		t.Fatalf("conflist %s", b)
	}
	for _, s := range []string{`"dataDir": "/tmp/x/ipam"`, `"subnet": "10.244.0.0/24"`, `"isGateway": true`} {
		if !strings.Contains(string(b), s) {
			t.Errorf("conflist lacks %s:\n%s", s, b)
		}
	}
}

func TestKubeletConfig(t *testing.T) {
	taint := corev1.Taint{Key: "cni.istio.io/not-ready", Value: "true", Effect: corev1.TaintEffectNoSchedule}
	b, err := kubeletConfig(kubeletPaths{RootDir: "/r", PodLogsDir: "/l", VolumePluginDir: "/v", ResolvConf: "/rc", RuntimeEndpoint: "unix:///c.sock", StaticPodPath: "/m"}, "cg-root", 20250, 12345, []corev1.Taint{taint})
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{
		"kind": "KubeletConfiguration", "failCgroupV1": false, "cgroupDriver": "cgroupfs", "cgroupRoot": "/cg-root",
		"makeIPTablesUtilChains": false, "port": float64(20250), "healthzPort": float64(12345),
		"containerRuntimeEndpoint": "unix:///c.sock", "podLogsDir": "/l", "volumePluginDir": "/v",
		"staticPodPath": "/m",
	} {
		if cfg[k] != want {
			t.Errorf("%s = %v, want %v", k, cfg[k], want)
		}
	}
	var typed struct {
		RegisterWithTaints []corev1.Taint `json:"registerWithTaints"`
	}
	if err := yaml.Unmarshal(b, &typed); err != nil {
		t.Fatal(err)
	}
	if len(typed.RegisterWithTaints) != 1 || typed.RegisterWithTaints[0].Key != taint.Key || typed.RegisterWithTaints[0].Effect != taint.Effect {
		t.Errorf("registerWithTaints = %+v, want [%+v]", typed.RegisterWithTaints, taint)
	}
}

func TestContainerdConfig(t *testing.T) {
	c := containerdConfig("/d", "/d/c.sock", "/usr/bin/runc", "/cni/bin", "/cni/net.d")
	for _, s := range []string{
		`root = "/d/root"`, `state = "/d/state"`, `address = "/d/c.sock"`,
		`sandbox_image = "` + PauseImage + `"`, "disable_apparmor = true", "restrict_oom_score_adj = true",
		`snapshotter = "overlayfs"`, "SystemdCgroup = false",
		`Root = "/d/runc"`, `bin_dir = "/cni/bin"`, `conf_dir = "/cni/net.d"`, "max_conf_num = 1",
	} {
		if !strings.Contains(c, s) {
			t.Errorf("config lacks %s:\n%s", s, c)
		}
	}
}

// An image tarball reads back with its tag, the entrypoint, and the binary
// as the only file.
func TestWriteImage(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img.tar")
	if err := writeImage(path, AppImage, "httpapp", []byte("#!binary")); err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(AppImage)
	if err != nil {
		t.Fatal(err)
	}
	img, err := tarball.ImageFromPath(path, &tag)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(cfg.Config.Entrypoint, " ") != "/httpapp" || cfg.OS != "linux" || len(cfg.RootFS.DiffIDs) != 1 {
		t.Errorf("config %+v", cfg)
	}
	tr := tar.NewReader(mutate.Extract(img))
	h, err := tr.Next()
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(tr)
	if h.Name != "httpapp" || h.Mode != 0o755 || string(body) != "#!binary" {
		t.Errorf("file %s mode %o content %q", h.Name, h.Mode, body)
	}
	if _, err := tr.Next(); err != io.EOF {
		t.Errorf("more than one file in the image: %v", err)
	}
}

// emptyDir leaves a "rebooted" /run dir: the dir itself, with nothing in it,
// and nothing mounted below it any more (netns files and container root
// filesystems are mount points).
func TestEmptyDirUnmountsAndEmpties(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	mnt := filepath.Join(dir, "task", "rootfs")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	for _, f := range []string{filepath.Join(mnt, "inside"), filepath.Join(dir, "state.json")} {
		if err := os.WriteFile(f, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "ambientd-e2e-keep"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := emptyDir(dir, keepNodeNetns); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "ambientd-e2e-keep")); err != nil {
		t.Errorf("the node's own netns entry was not kept: %v", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 0 {
		t.Fatalf("after emptyDir: %v entries %v, want the dir empty", err, entries)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), mnt) {
		t.Errorf("%s still mounted", mnt)
	}
	if err := emptyDir(filepath.Join(dir, "missing"), nil); err != nil {
		t.Errorf("emptyDir of a missing dir: %v", err)
	}
}

// TestRemoveMountPointsLeavesForeignMounts: a mount point the run created
// that another tool turned into a mount (ip netns does so with /run/netns on
// a fresh machine) is left in place with a note, not reported as a failure;
// an empty one is removed.
func TestRemoveMountPointsLeavesForeignMounts(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	mounted, empty := filepath.Join(dir, "netns"), filepath.Join(dir, "empty")
	for _, d := range []string{mounted, empty} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount(mounted, mounted, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mounted, unix.MNT_DETACH) })
	notes, err := removeMountPoints([]string{mounted, empty})
	if err != nil {
		t.Fatalf("removeMountPoints: %v", err)
	}
	if len(notes) != 1 || !strings.HasPrefix(notes[0], mounted) {
		t.Errorf("notes %v, want one about %s", notes, mounted)
	}
	if _, err := os.Stat(empty); !os.IsNotExist(err) {
		t.Errorf("%s not removed: %v", empty, err)
	}
}
