package cniinstall

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// A temporary host tree: <root>/opt/cni/bin, <root>/etc/cni/net.d and the
// plugin binary "in the image".
type hostTree struct {
	root, bin, conf, src string
}

func newHostTree(t *testing.T) hostTree {
	t.Helper()
	root := t.TempDir()
	h := hostTree{root: root, bin: filepath.Join(root, "opt/cni/bin"), conf: filepath.Join(root, "etc/cni/net.d"), src: filepath.Join(root, "image/ambientd-cni")}
	for _, d := range []string{h.bin, h.conf, filepath.Dir(h.src)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, h.src, "#!/bin/sh\n# plugin v2\n", 0o755)
	return h
}

func (h hostTree) config() Config {
	return Config{
		BinSource: h.src, BinDir: h.bin, ConfDir: h.conf,
		Entry: Entry{Type: "ambientd-cni", PluginSettings: cniapi.PluginSettings{AgentSocket: "/var/run/ambientd/cni.sock", Timeout: "30s"}},
	}
}

func (h hostTree) installer(t *testing.T, mutate ...func(*Config)) *Installer {
	t.Helper()
	cfg := h.config()
	for _, m := range mutate {
		m(&cfg)
	}
	i, err := New(cfg, testutil.Logger(t, slog.LevelDebug))
	if err != nil {
		t.Fatal(err)
	}
	return i
}

func (h hostTree) path(name string) string { return filepath.Join(h.conf, name) }

// inPlace selects in-place mode (the default is owned mode).
func inPlace(c *Config) { c.InPlace = true }

func writeFile(t *testing.T, path, data string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil { // umask-proof
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func exists(path string) bool { _, err := os.Stat(path); return err == nil }

// runtimeView loads the conf dir the way a runtime does (first valid file)
// and returns the chain's plugin types.
func runtimeView(t *testing.T, dir string) (string, []string) {
	t.Helper()
	confs, err := listConfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	c, err := runtimeChoice(dir, confs)
	if err != nil {
		t.Fatal(err)
	}
	var l *libcni.NetworkConfigList
	if c.list {
		l, err = libcni.ConfListFromFile(c.path)
	} else {
		var pc *libcni.PluginConfig
		//lint:ignore SA1019 runtimes (containerd's go-cni, CRI-O's ocicni) still load single-plugin files this way
		if pc, err = libcni.ConfFromFile(c.path); err == nil {
			//lint:ignore SA1019 runtimes (containerd's go-cni, CRI-O's ocicni) still load single-plugin files this way
			l, err = libcni.ConfListFromConf(pc)
		}
	}
	if err != nil {
		t.Fatalf("runtime cannot load %s: %v", c.path, err)
	}
	var types []string
	for _, p := range l.Plugins {
		types = append(types, p.Network.Type)
	}
	return c.name, types
}

const flannelConflist = `{
  "name": "cbr0",
  "cniVersion": "1.0.0",
  "unknownTopLevel": {"z": 1, "a": [1.50, 2e3]},
  "plugins": [
    {
      "type": "flannel",
      "delegate": {"hairpinMode": true, "isDefaultGateway": true}
    },
    {
      "type": "portmap",
      "capabilities": {"portMappings": true}
    }
  ]
}
`

const bridgeConf = `{
    "cniVersion": "0.4.0",
    "name": "mynet",
    "type": "bridge",
    "bridge": "cni0",
    "ipam": {"type": "host-local", "subnet": "10.22.0.0/16"}
}
`

func TestInstallFirstTime(t *testing.T) {
	cases := []struct {
		name, file, content string
		mode                os.FileMode
		wantFile            string // in-place mode
		wantChain           []string
	}{
		{"conflist", "10-flannel.conflist", flannelConflist, 0o640, "10-flannel.conflist", []string{"flannel", "portmap", "ambientd-cni"}},
		{"conf becomes conflist", "10-mynet.conf", bridgeConf, 0o600, "10-mynet.conflist", []string{"bridge", "ambientd-cni"}},
		{"json becomes conflist", "10-mynet.json", bridgeConf, 0o644, "10-mynet.conflist", []string{"bridge", "ambientd-cni"}},
		{"compact conflist", "05-c.conflist", `{"cniVersion":"1.0.0","name":"c","plugins":[{"type":"ptp"}]}`, 0o644, "05-c.conflist", []string{"ptp", "ambientd-cni"}},
	}
	for _, owned := range []bool{true, false} {
		for _, tc := range cases {
			name := "in-place/" + tc.name
			if owned {
				name = "owned/" + tc.name
			}
			t.Run(name, func(t *testing.T) {
				h := newHostTree(t)
				writeFile(t, h.path(tc.file), tc.content, tc.mode)
				i := h.installer(t, func(c *Config) { c.InPlace = !owned })
				if _, err := i.Install(); err != nil {
					t.Fatal(err)
				}
				if err := i.Check(); err != nil {
					t.Fatalf("Check after install: %v", err)
				}
				wantFile, wantMode := tc.wantFile, tc.mode
				if owned {
					wantFile, wantMode = DefaultOwnedName, 0o600
				}
				name, chain := runtimeView(t, h.conf)
				if name != wantFile || strings.Join(chain, ",") != strings.Join(tc.wantChain, ",") {
					t.Fatalf("runtime uses %s with %v, want %s with %v", name, chain, wantFile, tc.wantChain)
				}
				if owned && readFile(t, h.path(tc.file)) != tc.content {
					t.Fatalf("owned mode changed the primary's %s", tc.file)
				}
				if !owned && tc.file != wantFile && exists(h.path(tc.file)) {
					t.Fatalf("%s still there: it would sort before %s", tc.file, wantFile)
				}
				fi, _ := os.Stat(h.path(wantFile))
				if fi.Mode().Perm() != wantMode {
					t.Fatalf("mode %v, want %v", fi.Mode().Perm(), wantMode)
				}
				if got := readFile(t, filepath.Join(h.bin, "ambientd-cni")); got != readFile(t, h.src) {
					t.Fatal("binary not installed")
				}
				// Idempotent: a second pass changes nothing.
				before := readFile(t, h.path(wantFile))
				if changed, err := i.Install(); err != nil || changed {
					t.Fatalf("second Install: changed=%v err=%v", changed, err)
				}
				if readFile(t, h.path(wantFile)) != before {
					t.Fatal("second Install rewrote the config")
				}
				// Uninstall gives back the original, byte for byte, same name and mode.
				if err := i.Uninstall(); err != nil {
					t.Fatal(err)
				}
				if got := readFile(t, h.path(tc.file)); got != tc.content {
					t.Fatalf("after uninstall %s =\n%s\nwant the original\n%s", tc.file, got, tc.content)
				}
				if fi, _ := os.Stat(h.path(tc.file)); fi.Mode().Perm() != tc.mode {
					t.Fatalf("after uninstall mode %v, want %v", fi.Mode().Perm(), tc.mode)
				}
				if tc.file != wantFile && exists(h.path(wantFile)) {
					t.Fatalf("%s left behind", wantFile)
				}
				if entries, _ := os.ReadDir(h.conf); len(entries) != 1 {
					t.Fatalf("conf dir after uninstall has %d entries, want only %s", len(entries), tc.file)
				}
				if exists(filepath.Join(h.bin, "ambientd-cni")) {
					t.Fatal("binary left behind")
				}
				if i.Check() == nil {
					t.Fatal("Check says installed after uninstall")
				}
			})
		}
	}
}

// Everything but our entry stays as written: key order, unknown fields,
// number spelling, whitespace.
func TestInstallPreservesOtherBytes(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	i := h.installer(t, inPlace)
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	got := readFile(t, h.path("10-flannel.conflist"))
	stripped, n, err := removeEntries([]byte(got), "ambientd-cni")
	if err != nil || n != 1 {
		t.Fatalf("removeEntries: n=%d err=%v", n, err)
	}
	if string(stripped) != flannelConflist {
		t.Fatalf("other bytes changed:\n%s", got)
	}
	if !strings.Contains(got, `"a": [1.50, 2e3]`) {
		t.Fatalf("numbers reformatted:\n%s", got)
	}
	var entry map[string]any
	l, _ := parseList([]byte(got))
	last := l.elems[len(l.elems)-1]
	if err := json.Unmarshal([]byte(got[last.start:last.end]), &entry); err != nil {
		t.Fatal(err)
	}
	if entry["agentSocket"] != "/var/run/ambientd/cni.sock" || entry["timeout"] != "30s" {
		t.Fatalf("our entry = %v", entry)
	}
}

// An older entry of ours, anywhere in the list and with other settings, is
// replaced by one current entry, last; another mesh's entry stays.
func TestInstallReplacesOlderEntry(t *testing.T) {
	h := newHostTree(t)
	old := `{"cniVersion":"1.0.0","name":"k","plugins":[{"type":"calico"},{"type":"ambientd-cni","timeout":"5s"},{"type":"istio-cni","x":1},{"type":"portmap"}]}`
	writeFile(t, h.path("10-calico.conflist"), old, 0o644)
	i := h.installer(t, inPlace)
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	_, chain := runtimeView(t, h.conf)
	if strings.Join(chain, ",") != "calico,istio-cni,portmap,ambientd-cni" {
		t.Fatalf("chain %v", chain)
	}
	if strings.Contains(readFile(t, h.path("10-calico.conflist")), `"5s"`) {
		t.Fatal("old entry's settings kept")
	}
	if err := i.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, h.path("10-calico.conflist")); got != `{"cniVersion":"1.0.0","name":"k","plugins":[{"type":"calico"},{"type":"istio-cni","x":1},{"type":"portmap"}]}` {
		t.Fatalf("uninstall touched others' entries: %s", got)
	}
}

func TestInvalidFilesSkipped(t *testing.T) {
	h := newHostTree(t)
	invalid := map[string]string{
		"00-broken.conflist": `{"name": "x", "plugins": [`,
		"01-notype.conf":     `{"cniVersion":"1.0.0","name":"x"}`,
		"02-empty.conflist":  `{"cniVersion":"1.0.0","name":"x","plugins":[]}`,
		"03-noname.conflist": `{"cniVersion":"1.0.0","plugins":[{"type":"a"}]}`,
		"04-array.json":      `[1,2]`,
	}
	for n, c := range invalid {
		writeFile(t, h.path(n), c, 0o644)
	}
	writeFile(t, h.path("05-other.txt"), "not a config", 0o644)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	writeFile(t, h.path("20-later.conflist"), `{"cniVersion":"1.0.0","name":"l","plugins":[{"type":"a"}]}`, 0o644)
	i := h.installer(t, inPlace)
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	if name, chain := runtimeView(t, h.conf); name != "10-flannel.conflist" || chain[len(chain)-1] != "ambientd-cni" {
		t.Fatalf("runtime uses %s %v", name, chain)
	}
	for n, c := range invalid {
		if readFile(t, h.path(n)) != c {
			t.Fatalf("invalid %s was modified", n)
		}
	}
	if strings.Contains(readFile(t, h.path("20-later.conflist")), "ambientd") {
		t.Fatal("a file the runtime does not use was modified")
	}
}

// --cni-conf-name names the primary. Readiness judges the file the runtime
// really uses: in in-place mode, an earlier valid file shadows the named
// one, and Check says so; in owned mode the copy of the named file sorts
// first and is used.
func TestConfName(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	writeFile(t, h.path("99-mine.conflist"), `{"cniVersion":"1.0.0","name":"m","plugins":[{"type":"a"}]}`, 0o644)
	i := h.installer(t, inPlace, func(c *Config) { c.ConfName = "99-mine.conflist" })
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(readFile(t, h.path("99-mine.conflist")), "ambientd-cni") || strings.Contains(readFile(t, h.path("10-flannel.conflist")), "ambientd-cni") {
		t.Fatal("--cni-conf-name not honoured")
	}
	err := i.Check()
	if err == nil || !strings.Contains(err.Error(), "10-flannel.conflist") || !strings.Contains(err.Error(), "sorts before --cni-conf-name 99-mine.conflist") {
		t.Fatalf("Check with the runtime on 10-flannel.conflist = %v, want not installed, naming the file the runtime uses", err)
	}

	// Owned mode: the copy of 99-mine sorts first; the runtime calls us.
	o := h.installer(t, func(c *Config) { c.ConfName = "99-mine.conflist" })
	if _, err := o.Install(); err != nil {
		t.Fatal(err)
	}
	if name, chain := runtimeView(t, h.conf); name != DefaultOwnedName || strings.Join(chain, ",") != "a,ambientd-cni" {
		t.Fatalf("runtime uses %s %v", name, chain)
	}
	if err := o.Check(); err != nil {
		t.Fatal(err)
	}
}

func TestBinaryUpgrade(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	dst := filepath.Join(h.bin, "ambientd-cni")
	writeFile(t, dst, "#!/bin/sh\n# plugin v1 (older)\n", 0o755)
	writeFile(t, filepath.Join(h.bin, "bridge"), "someone else's", 0o755)
	i := h.installer(t)
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	if readFile(t, dst) != readFile(t, h.src) {
		t.Fatal("older binary not replaced")
	}
	if fi, _ := os.Stat(dst); fi.Mode().Perm() != 0o755 {
		t.Fatalf("binary mode %v", fi.Mode().Perm())
	}
	entries, _ := os.ReadDir(h.bin)
	if len(entries) != 2 {
		t.Fatalf("bin dir has %d entries (temp file left?)", len(entries))
	}
	if err := i.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if readFile(t, filepath.Join(h.bin, "bridge")) != "someone else's" {
		t.Fatal("uninstall touched another plugin")
	}
}

// runInstaller starts Run until stop (or the test's cleanup).
func runInstaller(t *testing.T, i *Installer) (stop func()) {
	t.Helper()
	return testutil.Run(t, i.Run)
}

func waitInstalled(t *testing.T, i *Installer, what string) {
	t.Helper()
	testutil.Eventually(t, what, 10*time.Second, func() bool { return i.Check() == nil })
}

func TestRunWaitsForConfig(t *testing.T) {
	h := newHostTree(t)
	i := h.installer(t)
	runInstaller(t, i)
	testutil.Eventually(t, "binary installed", 10*time.Second, func() bool { return exists(filepath.Join(h.bin, "ambientd-cni")) })
	if err := i.Check(); err == nil || !strings.Contains(err.Error(), "no valid CNI config") {
		t.Fatalf("Check before any config = %v", err)
	}
	// The primary CNI writes its config later, through a temp file.
	writeFile(t, h.path(".tmp"), flannelConflist, 0o644)
	if err := os.Rename(h.path(".tmp"), h.path("10-flannel.conflist")); err != nil {
		t.Fatal(err)
	}
	waitInstalled(t, i, "plugin inserted into the config that appeared")
	if err := i.Check(); err != nil {
		t.Fatalf("not installed after install: %v", err)
	}
}

func TestRunRepairsExternalRewrites(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	i := h.installer(t, inPlace)
	runInstaller(t, i)
	waitInstalled(t, i, "first install")

	// The primary CNI rewrites its file at boot, dropping our entry.
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	waitInstalled(t, i, "entry re-inserted after a rewrite")

	// Another component adds a config that sorts first.
	writeFile(t, h.path("05-cilium.conflist"), `{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"}]}`, 0o600)
	waitInstalled(t, i, "entry inserted into the new first config")
	if name, _ := runtimeView(t, h.conf); name != "05-cilium.conflist" {
		t.Fatalf("runtime uses %s", name)
	}

	// Our binary is deleted, then replaced by something else.
	if err := os.Remove(filepath.Join(h.bin, "ambientd-cni")); err != nil {
		t.Fatal(err)
	}
	waitInstalled(t, i, "binary re-installed after deletion")
	writeFile(t, filepath.Join(h.bin, "ambientd-cni"), "stale", 0o755)
	testutil.Eventually(t, "binary restored after overwrite", 10*time.Second, func() bool {
		b, _ := os.ReadFile(filepath.Join(h.bin, "ambientd-cni"))
		return string(b) == readFile(t, h.src)
	})
}

// Stopping Run (an upgrade) leaves everything installed.
func TestStopLeavesInstalled(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	i := h.installer(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- i.Run(ctx) }()
	waitInstalled(t, i, "install")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err != nil {
		t.Fatalf("after stop: %v", err)
	}
}

func TestOwnedMode(t *testing.T) {
	cases := []struct{ name, file, content string }{
		{"conflist primary", "10-flannel.conflist", flannelConflist},
		{"conf primary", "10-mynet.conf", bridgeConf},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostTree(t)
			writeFile(t, h.path(tc.file), tc.content, 0o644)
			i := h.installer(t)
			runInstaller(t, i)
			waitInstalled(t, i, "owned config written")
			name, chain := runtimeView(t, h.conf)
			if name != DefaultOwnedName || chain[len(chain)-1] != "ambientd-cni" {
				t.Fatalf("runtime uses %s %v", name, chain)
			}
			if fi, _ := os.Stat(h.path(DefaultOwnedName)); fi.Mode().Perm() != 0o600 {
				t.Fatalf("owned file mode %v, want 0600", fi.Mode().Perm())
			}
			if readFile(t, h.path(tc.file)) != tc.content {
				t.Fatal("owned mode edited the primary")
			}
			// The primary changes (its CNI reconfigures): the copy follows.
			changed := strings.Replace(tc.content, `"type": "`, `"type": "`, 1)
			changed = strings.Replace(changed, "{", `{"addedByPrimary": "v2",`, 1)
			writeFile(t, h.path(tc.file), changed, 0o644)
			testutil.Eventually(t, "owned copy follows the primary", 10*time.Second, func() bool {
				b, _ := os.ReadFile(h.path(DefaultOwnedName))
				return bytes.Contains(b, []byte("addedByPrimary")) && i.Check() == nil
			})
			// Someone deletes our file: it comes back.
			if err := os.Remove(h.path(DefaultOwnedName)); err != nil {
				t.Fatal(err)
			}
			waitInstalled(t, i, "owned config re-created")
			if err := i.Uninstall(); err != nil {
				t.Fatal(err)
			}
			if exists(h.path(DefaultOwnedName)) || readFile(t, h.path(tc.file)) != changed {
				t.Fatal("uninstall left the owned file or touched the primary")
			}
		})
	}
}

// Switching to in-place mode removes the owned file and inserts into the primary.
func TestOwnedModeOff(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	if _, err := h.installer(t).Install(); err != nil {
		t.Fatal(err)
	}
	i := h.installer(t, inPlace)
	if _, err := i.Install(); err != nil {
		t.Fatal(err)
	}
	if exists(h.path(DefaultOwnedName)) {
		t.Fatal("owned file kept")
	}
	if name, _ := runtimeView(t, h.conf); name != "10-flannel.conflist" || i.Check() != nil {
		t.Fatalf("runtime uses %s, check %v", name, i.Check())
	}
}

func TestOwnedNameMustSortFirst(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("00-aaa.conflist"), `{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"a"}]}`, 0o644)
	i := h.installer(t, func(c *Config) { c.OwnedName = "50-ambientd.conflist" })
	if _, err := i.Install(); err == nil || !strings.Contains(err.Error(), "sorts before") {
		t.Fatalf("Install = %v, want a sorts-before error", err)
	}
}

func TestCheckNotLast(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-x.conflist"), `{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"a"},{"type":"ambientd-cni"},{"type":"b"}]}`, 0o644)
	i := h.installer(t, inPlace)
	if _, err := i.ensureBinary(); err != nil {
		t.Fatal(err)
	}
	if err := i.Check(); err == nil {
		t.Fatal("Check accepts our entry not being last")
	}
}

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"relative bin dir", func(c *Config) { c.BinDir = "opt/cni/bin" }, "absolute"},
		{"conf name with slash", func(c *Config) { c.ConfName = "../x.conflist" }, "plain file name"},
		{"conf name extension", func(c *Config) { c.ConfName = "x.yaml" }, ".conf, .conflist or .json"},
		{"owned name extension", func(c *Config) { c.OwnedName = "00-a.conf" }, "must end in .conflist"},
	}
	h := newHostTree(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := h.config()
			tc.mutate(&cfg)
			if _, err := New(cfg, slog.Default()); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New = %v, want error containing %q", err, tc.want)
			}
		})
	}
}

func TestLoopGuard(t *testing.T) {
	g := newLoopGuard(time.Minute, 3)
	now := time.Unix(1000, 0)
	for k := 1; k <= 3; k++ {
		if _, fighting := g.repaired(now.Add(time.Duration(k) * time.Second)); fighting || g.delay() != 0 {
			t.Fatalf("repair %d: fighting too early", k)
		}
	}
	var last time.Duration
	for k := 4; k <= 12; k++ {
		n, fighting := g.repaired(now.Add(time.Duration(k) * time.Second))
		if !fighting || n != k || g.delay() < last {
			t.Fatalf("repair %d: n=%d fighting=%v delay=%v", k, n, fighting, g.delay())
		}
		last = g.delay()
	}
	if last != maxBackoff {
		t.Fatalf("backoff %v, want capped at %v", last, maxBackoff)
	}
	// A quiet window resets it.
	if _, fighting := g.repaired(now.Add(time.Hour)); fighting || g.delay() != 0 {
		t.Fatal("guard did not reset after a quiet window")
	}
}

// syncBuffer is a log sink safe for the installer's goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Another component that keeps dropping our entry (Cilium's exclusive
// mode, a primary CNI rewriting at every reconcile): the installer keeps
// re-inserting, warns, and backs off instead of spinning.
func TestRunFightIsDetected(t *testing.T) {
	h := newHostTree(t)
	path := h.path("10-flannel.conflist")
	writeFile(t, path, flannelConflist, 0o644)
	var logs syncBuffer
	cfg := h.config()
	cfg.InPlace = true
	cfg.RepairLimit = 2
	i, err := New(cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	runInstaller(t, i)
	waitInstalled(t, i, "first install")

	stop := make(chan struct{})
	fought := make(chan int)
	go func() { // the fighter: strip our entry whenever it shows up
		n := 0
		defer func() { fought <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if b, _ := os.ReadFile(path); bytes.Contains(b, []byte("ambientd-cni")) {
				_ = os.WriteFile(path, []byte(flannelConflist), 0o644) // not t.Fatal: another goroutine
				n++
			}
			runtime.Gosched()
		}
	}()
	testutil.Eventually(t, "fight warning", 30*time.Second, func() bool {
		return strings.Contains(logs.String(), "another component keeps rewriting")
	})
	close(stop)
	t.Logf("fighter stripped our entry %d times before the warning", <-fought)
	waitInstalled(t, i, "entry back once the fight stops")
}

// Switching modes — the upgrade from in-place mode (the old default) to
// owned mode, and back — never leaves the runtime on a config without our
// plugin: after every single change the installer makes to the conf dir,
// the runtime's config has our plugin last. At the end of each switch the
// layout is the mode's, and uninstall gives back the original byte for byte.
func TestModeSwitchKeepsOurPluginInUse(t *testing.T) {
	cases := []struct{ name, file, content string }{
		{"conflist", "10-flannel.conflist", flannelConflist},
		{"conf", "10-mynet.conf", bridgeConf},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostTree(t)
			writeFile(t, h.path(tc.file), tc.content, 0o644)
			if _, err := h.installer(t, inPlace).Install(); err != nil {
				t.Fatal(err)
			}
			for _, toInPlace := range []bool{false, true, false} {
				i := h.installer(t, func(c *Config) { c.InPlace = toInPlace })
				steps := 0
				i.stepped = func() {
					steps++
					if name, chain := runtimeView(t, h.conf); chain[len(chain)-1] != "ambientd-cni" {
						t.Errorf("to in-place=%v, after step %d the runtime uses %s %v, without our plugin", toInPlace, steps, name, chain)
					}
				}
				if _, err := i.Install(); err != nil {
					t.Fatal(err)
				}
				if err := i.Check(); err != nil {
					t.Fatal(err)
				}
				if toInPlace == exists(h.path(DefaultOwnedName)) {
					t.Fatalf("in-place=%v: owned file present=%v", toInPlace, !toInPlace)
				}
				if !toInPlace && readFile(t, h.path(tc.file)) != tc.content {
					t.Fatalf("owned mode left the primary changed:\n%s", readFile(t, h.path(tc.file)))
				}
				t.Logf("to in-place=%v: %d steps, the runtime on our plugin after each", toInPlace, steps)
			}
			if err := h.installer(t).Uninstall(); err != nil {
				t.Fatal(err)
			}
			if entries, _ := os.ReadDir(h.conf); len(entries) != 1 || readFile(t, h.path(tc.file)) != tc.content {
				t.Fatalf("after uninstall: %d files, %s =\n%s", len(entries), tc.file, readFile(t, h.path(tc.file)))
			}
		})
	}
}
