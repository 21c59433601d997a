package cniinstall

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/ambientd/ambientd/test/infra/multusemu"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// The conf dir with other writers that follow their documented rules: the
// installer and each of them must reach a fixed point (no file changes any
// more), with the runtime running the node's meta-plugin (Multus) when
// there is one, and our plugin exactly once per ADD, last.

const calicoConflist = `{
  "name": "k8s-pod-network",
  "cniVersion": "1.0.0",
  "plugins": [
    {"type": "calico", "mtu": 1440},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// effectiveChain is what one ADD runs through the runtime's config: its
// plugins in order, a Multus plugin replaced by what it runs (its
// delegates, each a config or a conflist, as Multus's thin plugin does
// for its cluster network), marked "multus(" … ")".
func effectiveChain(t *testing.T, dir string) (file string, chain []string) {
	t.Helper()
	confs, err := listConfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	c, err := runtimeChoice(dir, confs)
	if err != nil {
		t.Fatalf("runtime's config: %v", err)
	}
	var v map[string]any
	if err := json.Unmarshal(c.data, &v); err != nil {
		t.Fatal(err)
	}
	return c.name, multusemu.Expand(v)
}

// waitFixedPoint waits (at most within) until the conf dir has not changed
// for quiet, and returns how long that took and the files then.
func waitFixedPoint(t *testing.T, dir string, within, quiet time.Duration) (time.Duration, map[string]string) {
	t.Helper()
	took, files, err := multusemu.WaitFixedPoint(dir, within, quiet)
	if err != nil {
		t.Fatal(err)
	}
	return took, files
}

// multusTick is the emulated Multus's watch period here, a tenth of the
// real one's (multusemu.DefaultInterval), and multusQuiet how long the conf
// dir must stay unchanged to be a fixed point: ten of Multus's looks (with
// the real period it was three, in 3 s), each a chance to rewrite its file.
const (
	multusTick  = 100 * time.Millisecond
	multusQuiet = 10 * multusTick
)

// runMultus runs one life of Multus's thin auto-config writer beside the
// installer (looking every multusTick); stop ends it (Multus removes its
// file as it exits).
func runMultus(t *testing.T, dir string) (stop func()) {
	t.Helper()
	return testutil.Run(t, multusemu.Restarting(func() *multusemu.Thin {
		return &multusemu.Thin{Dir: dir, Interval: multusTick}
	}, multusTick, func(err error) { t.Logf("emulated Multus exited, restarting it: %v", err) }))
}

// assertMultusChain: the runtime runs Multus (its secondary networks are
// not bypassed), no Multus inside a Multus, our plugin exactly once and last,
// and readiness agrees.
func assertMultusChain(t *testing.T, i *Installer, dir string, files map[string]string) {
	t.Helper()
	name, chain := effectiveChain(t, dir)
	t.Logf("runtime's config %s runs %v", name, chain)
	if !slices.Contains(chain, "multus(") {
		t.Errorf("the runtime's config %s bypasses Multus: %v\n%s", name, chain, multusemu.Dump(files))
	}
	if multusemu.Nested(chain) {
		t.Errorf("Multus nests inside itself in %s: %v\n%s", name, chain, multusemu.Dump(files))
	}
	for n, text := range files {
		var v map[string]any
		if json.Unmarshal([]byte(text), &v) == nil && multusemu.Nested(multusemu.Expand(v)) {
			t.Errorf("%s nests Multus inside itself:\n%s", n, text)
		}
	}
	real := multusemu.Plugins(chain)
	if n := strings.Count(strings.Join(real, " ")+" ", "ambientd-cni "); n != 1 || real[len(real)-1] != "ambientd-cni" {
		t.Errorf("our plugin runs %d times per ADD (chain %v), want once, last", n, chain)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check: %v", err)
	}
}

// Multus (thin plugin, auto-config) starts beside a running agent — it
// takes the lexically first file as its master, which is our owned copy —
// and later restarts (regenerates from scratch). Each time, within 10 s both
// writers stop changing files, no config nests Multus in itself, the
// runtime runs Multus, and our plugin runs exactly once per ADD, last.
func TestMultusReachesAFixedPoint(t *testing.T) {
	t.Parallel() // mostly waiting for a quiet conf dir of its own
	h := newHostTree(t)
	writeFile(t, h.path("10-calico.conflist"), calicoConflist, 0o644)
	i := h.installer(t)
	runInstaller(t, i)
	waitInstalled(t, i, "installed before Multus")

	stop := runMultus(t, h.conf)
	took, files := waitFixedPoint(t, h.conf, 10*time.Second, multusQuiet)
	t.Logf("Multus started beside the agent: fixed point after %s", took.Round(time.Millisecond))
	assertMultusChain(t, i, h.conf, files)

	stop() // Multus restarts: its file goes, then it regenerates from scratch
	runMultus(t, h.conf)
	took, files = waitFixedPoint(t, h.conf, 10*time.Second, multusQuiet)
	t.Logf("Multus restarted: fixed point after %s", took.Round(time.Millisecond))
	assertMultusChain(t, i, h.conf, files)

	// The primary rewrites its file (a Calico upgrade): it reaches the
	// runtime through Multus, still with our plugin once.
	writeFile(t, h.path("10-calico.conflist"), strings.Replace(calicoConflist, "1440", "1400", 1), 0o644)
	took, files = waitFixedPoint(t, h.conf, 10*time.Second, multusQuiet)
	t.Logf("primary rewritten: fixed point after %s", took.Round(time.Millisecond))
	assertMultusChain(t, i, h.conf, files)
	_, chainText := effectiveChain(t, h.conf)
	if !strings.Contains(multusemu.Dump(files), `1400`) {
		t.Errorf("the primary's new text does not reach the runtime (%v):\n%s", chainText, multusemu.Dump(files))
	}
}

// Multus already runs (its file is there) when the agent installs for the
// first time: the same fixed point.
func TestMultusBeforeTheAgent(t *testing.T) {
	t.Parallel() // mostly waiting for a quiet conf dir of its own
	h := newHostTree(t)
	writeFile(t, h.path("10-calico.conflist"), calicoConflist, 0o644)
	runMultus(t, h.conf)
	testutil.Eventually(t, "Multus wrote its file", 10*time.Second, func() bool { return exists(h.path("00-multus.conflist")) })
	i := h.installer(t)
	runInstaller(t, i)
	took, files := waitFixedPoint(t, h.conf, 10*time.Second, multusQuiet)
	t.Logf("fixed point after %s", took.Round(time.Millisecond))
	assertMultusChain(t, i, h.conf, files)
}

// copyFirst is an installer that copies the lexically first valid config
// (other than its own) into its own file, with its entry last — what an
// installer with an owned copy does (Istio's owned config, Kuma's CNI).
func copyFirst(t *testing.T, dir, own, typ string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
			confs, err := listConfs(dir)
			if err != nil {
				continue
			}
			c, err := runtimeChoice(dir, confs, own)
			if err != nil || !c.list {
				continue
			}
			stripped, _, err := removeEntries(c.data, typ)
			if err != nil {
				continue
			}
			want, err := appendEntry(stripped, map[string]string{"type": typ})
			if err != nil {
				continue
			}
			if b, err := os.ReadFile(filepath.Join(dir, own)); err == nil && string(b) == string(want) {
				continue
			}
			_ = os.WriteFile(filepath.Join(dir, own)+".tmp", want, 0o600)
			_ = os.Rename(filepath.Join(dir, own)+".tmp", filepath.Join(dir, own))
		}
	}()
}

// Another installer that copies the first file: whichever of the two
// copies sorts first, the dir reaches a fixed point and nobody's copy
// grows; ours does not copy a file that already holds our plugin.
func TestCopyFirstInstallerReachesAFixedPoint(t *testing.T) {
	t.Parallel() // mostly waiting for a quiet conf dir of its own
	for _, own := range []string{"02-other.conflist", "00-aaa-other.conflist"} {
		t.Run(own, func(t *testing.T) {
			t.Parallel()
			h := newHostTree(t)
			writeFile(t, h.path("10-calico.conflist"), calicoConflist, 0o644)
			i := h.installer(t)
			runInstaller(t, i)
			copyFirst(t, h.conf, own, "other-cni")
			took, files := waitFixedPoint(t, h.conf, 10*time.Second, 2*time.Second)
			t.Logf("fixed point after %s", took.Round(time.Millisecond))
			for n, text := range files {
				if c := strings.Count(text, `"ambientd-cni"`); c > 1 {
					t.Errorf("%s holds our plugin %d times:\n%s", n, c, text)
				}
				if c := strings.Count(text, `"other-cni"`); c > 1 {
					t.Errorf("%s holds the other plugin %d times:\n%s", n, c, text)
				}
			}
			ours := files[DefaultOwnedName]
			if strings.Contains(ours, "other-cni") {
				t.Errorf("our copy took the other installer's copy of ours:\n%s", ours)
			}
		})
	}
}

// The primary withdraws its config (a CNI uninstall, a migration): within
// seconds our copy is gone too (the runtime no longer gets the withdrawn
// network through us) and Check says why; a new primary's file is then
// picked up, with our plugin last.
func TestPrimaryWithdrawnAndReplaced(t *testing.T) {
	const grace = 500 * time.Millisecond
	h := newHostTree(t)
	writeFile(t, h.path("10-calico.conflist"), calicoConflist, 0o644)
	i := h.installer(t, func(c *Config) { c.WithdrawGrace = grace })
	runInstaller(t, i)
	waitInstalled(t, i, "installed")

	if err := os.Remove(h.path("10-calico.conflist")); err != nil {
		t.Fatal(err)
	}
	gone := time.Now()
	testutil.Eventually(t, "our copy of the withdrawn primary gone", 10*time.Second, func() bool { return !exists(h.path(DefaultOwnedName)) })
	took := time.Since(gone)
	t.Logf("primary removed -> our copy removed: %s", took.Round(time.Millisecond))
	if took < grace {
		t.Fatalf("our copy removed %v after the primary, before the withdraw grace %v", took, grace)
	}
	err := i.Check()
	if err == nil || !strings.Contains(err.Error(), "withdrawn") || !strings.Contains(err.Error(), "10-calico.conflist") {
		t.Fatalf("Check after the primary withdrew = %v, want it to say the primary 10-calico.conflist withdrew", err)
	}
	t.Logf("Check: %v", err)

	writeFile(t, h.path("05-cilium.conflist"), `{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"}]}`, 0o600)
	back := time.Now()
	waitInstalled(t, i, "the new primary picked up")
	t.Logf("new primary -> installed: %s", time.Since(back).Round(time.Millisecond))
	name, types := runtimeView(t, h.conf)
	if name != DefaultOwnedName || !slices.Equal(types, []string{"cilium-cni", "ambientd-cni"}) {
		t.Fatalf("runtime uses %s %v, want our copy of the new primary, our plugin last", name, types)
	}
}

// Multus started after the agent took our copy as its master, so its
// file's cluster network runs our plugin (and Multus waits for that master,
// gone, keeping its file). The uninstall must take our plugin out of that
// delegate too: afterwards no config runs our plugin — the runtime would
// otherwise fail every pod on the missing binary — and the runtime still
// runs Multus with the primary.
func TestUninstallTakesUsOutOfMultus(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-calico.conflist"), calicoConflist, 0o644)
	i := h.installer(t)
	stop := runInstaller(t, i)
	waitInstalled(t, i, "installed before Multus")
	runMultus(t, h.conf)
	_, files := waitFixedPoint(t, h.conf, 10*time.Second, 3*time.Second)
	assertMultusChain(t, i, h.conf, files)
	if _, chain := effectiveChain(t, h.conf); !slices.Contains(chain, "ambientd-cni") || chain[len(chain)-1] == "ambientd-cni" && chain[len(chain)-2] == ")" {
		t.Fatalf("Multus did not take our copy as its master (%v): not the case under test", chain)
	}
	stop()
	if err := i.Uninstall(); err != nil {
		t.Fatalf("Uninstall: %v", err)
	}
	for name, text := range confDirSnapshotT(t, h.conf) {
		if strings.Contains(text, `"ambientd-cni"`) || strings.Contains(text, ownedKey) {
			t.Errorf("after the uninstall %s still holds our plugin:\n%s", name, text)
		}
	}
	name, chain := effectiveChain(t, h.conf)
	if want := []string{"multus(", "calico", "portmap", ")"}; !slices.Equal(chain, want) {
		t.Errorf("after the uninstall the runtime's config %s runs %v, want %v", name, chain, want)
	}
}

func confDirSnapshotT(t *testing.T, dir string) map[string]string {
	t.Helper()
	files, err := multusemu.Snapshot(dir)
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// A primary that rewrites its config as remove + write (not an atomic
// rename) is not a withdrawal: our copy stays through the gap, so the
// runtime never sees the primary's new file alone (a pod created then
// would start without our plugin), and then follows the new content.
func TestPrimaryRewrittenAsRemoveAndWrite(t *testing.T) {
	h := newHostTree(t)
	primary := h.path("10-calico.conflist")
	writeFile(t, primary, calicoConflist, 0o644)
	var logs syncBuffer
	cfg := h.config()
	cfg.WithdrawGrace = time.Minute // far longer than the test: only a withdrawal would remove the copy
	i, err := New(cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	if err := w.Add(h.conf); err != nil {
		t.Fatal(err)
	}
	runInstaller(t, i)
	waitInstalled(t, i, "installed")

	if err := os.Remove(primary); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the installer noticed the primary missing", 10*time.Second, func() bool {
		return strings.Contains(logs.String(), "keeping our copy")
	})
	if name, types := runtimeView(t, h.conf); name != DefaultOwnedName || !slices.Equal(types, []string{"calico", "portmap", "ambientd-cni"}) {
		t.Fatalf("while the primary is rewritten the runtime uses %s %v, want our copy with our plugin last", name, types)
	}
	rewritten := strings.Replace(calicoConflist, `"k8s-pod-network"`, `"k8s-pod-network-v2"`, 1)
	writeFile(t, primary, rewritten, 0o644)
	testutil.Eventually(t, "our copy follows the rewritten primary", 10*time.Second, func() bool {
		b, _ := os.ReadFile(h.path(DefaultOwnedName))
		return bytes.Contains(b, []byte("k8s-pod-network-v2"))
	})
	if err := i.Check(); err != nil {
		t.Fatalf("Check after the rewrite = %v", err)
	}
	for {
		select {
		case ev := <-w.Events:
			if filepath.Base(ev.Name) == DefaultOwnedName && ev.Has(fsnotify.Remove) {
				t.Fatalf("our copy was removed during the primary's rewrite (%v): the runtime saw the primary alone", ev)
			}
			continue
		default:
		}
		break
	}
}

// A renamed --cni-owned-config-name leaves no copy behind: the copy under
// the earlier name sorted first would keep the runtime on it, a stale copy
// of the primary.
func TestRenamedOwnedConfigLeavesNoCopy(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-calico.conflist"), calicoConflist, 0o644)
	before := h.installer(t, func(c *Config) { c.OwnedName = "00-ambientd.conflist" })
	if _, err := before.Install(); err != nil {
		t.Fatal(err)
	}
	renamed := h.installer(t, func(c *Config) { c.OwnedName = "01-mesh.conflist" })
	if _, err := renamed.Install(); err != nil {
		t.Fatal(err)
	}
	if exists(h.path("00-ambientd.conflist")) {
		t.Fatal("the copy under the earlier owned name is still there")
	}
	if name, types := runtimeView(t, h.conf); name != "01-mesh.conflist" || !slices.Equal(types, []string{"calico", "portmap", "ambientd-cni"}) {
		t.Fatalf("the runtime uses %s %v, want the copy under the new name", name, types)
	}
	// And an uninstall takes every copy of ours, whatever its name.
	writeFile(t, h.path("00-ambientd.conflist"), readFile(t, h.path("01-mesh.conflist")), 0o600)
	if err := renamed.Uninstall(); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"00-ambientd.conflist", "01-mesh.conflist"} {
		if exists(h.path(n)) {
			t.Errorf("%s left after the uninstall", n)
		}
	}
}
