package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// The node as installed: the agent runs --install-cni (owned mode, the
// default) into a host-like CNI tree of the soak's own — a conf dir
// holding the primary's conflist (the chain's bridge and host-local), a
// bin dir the agent copies the plugin into, beside its install lease and
// the plugin's kubeconfig — and the runtime (libcni) runs whatever config
// it finds first in that conf dir at each ADD, DEL and CHECK. The agent's
// DaemonSet exists in the API, as it does on a node: the shutdown rule
// reads it (SIGTERM keeps the install) and the plugin asks for it while no
// agent answers.
const (
	primaryConfName   = "10-soak.conflist"
	daemonSetName     = "ambientd" // --daemonset-name's default, deploy/daemonset.yaml
	pluginAccount     = "ambientd-cni"
	revisionKey       = "soakRevision"
	followBound       = 10 * time.Second
	conflistFaultWait = 90 * time.Second
)

// hostTree is the node's CNI directories and the runtime reading them.
type hostTree struct {
	root, confDir, binDir, pluginLog string
	primary                          string // the primary's conflist
	// runtime runs the config a runtime picks in confDir, with plugins
	// from binDir (ours, as installed) and the reference plugins.
	runtime *e2eenv.Chain
}

// newHostTree makes the tree: the primary's conflist is the environment's
// plain chain (bridge, host-local with the environment's leases), so pods
// share the node's network with the prober.
// The plugin logs where the environment's chain had it log (kept with the
// environment's logs).
func newHostTree(env *e2eenv.Env) (*hostTree, error) {
	root, err := os.MkdirTemp("", "soak-host-")
	if err != nil {
		return nil, err
	}
	t := &hostTree{root: root, confDir: filepath.Join(root, "etc/cni/net.d"), binDir: filepath.Join(root, "opt/cni/bin"),
		pluginLog: env.CNIPluginLog}
	t.primary = filepath.Join(t.confDir, primaryConfName)
	for _, d := range []string{t.confDir, t.binDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, errors.Join(err, t.remove())
		}
	}
	primary, err := os.ReadFile(env.PlainChain.ConflistPath)
	if err != nil {
		return nil, errors.Join(err, t.remove())
	}
	if err := os.WriteFile(t.primary, primary, 0o644); err != nil {
		return nil, errors.Join(err, t.remove())
	}
	// Same bridge, subnet, result cache and leases as the environment's
	// chain; its own conflist (written beside the environment's) is never
	// read: RuntimeConfDir decides.
	t.runtime, err = e2eenv.NewChain(e2eenv.ChainConfig{
		BinDirs: []string{t.binDir, env.Bins.CNIRefDir}, Dir: filepath.Dir(env.Chain.CacheDir),
		ConfFile: "90-soak-unread.conflist", Bridge: env.Chain.Bridge(), Subnet: env.Chain.Subnet(),
		RuntimeConfDir: t.confDir,
	})
	if err != nil {
		return nil, errors.Join(err, t.remove())
	}
	return t, nil
}

func (t *hostTree) remove() error {
	if t.runtime != nil {
		_ = os.Remove(t.runtime.ConflistPath)
	}
	return os.RemoveAll(t.root)
}

// agentArgs install the plugin into the tree as the chart does (the
// plugin's own service account), with the soak's lease TTL; pluginBin is
// the binary to install.
func (t *hostTree) agentArgs(pluginBin string, leaseTTL time.Duration) []string {
	return []string{"--install-cni=true", "--cni-conf-dir=" + t.confDir, "--cni-bin-dir=" + t.binDir,
		"--cni-bin-source=" + pluginBin, "--cni-plugin-log-file=" + t.pluginLog,
		"--daemonset-namespace=" + e2eenv.AgentNamespace, "--daemonset-name=" + daemonSetName,
		"--cni-plugin-service-account=" + pluginAccount, "--cni-install-lease-ttl=" + leaseTTL.String()}
}

// ours reports whether the runtime's config runs our plugin last, and its
// text.
func (t *hostTree) ours() (bool, []byte) {
	rc, err := cniinstall.RuntimeConfig(t.confDir)
	if err != nil || len(rc.Types) == 0 {
		return false, nil
	}
	return rc.Types[len(rc.Types)-1] == cniapi.PluginType, rc.Data
}

// installed: the runtime's config runs our plugin, its binary and the
// install lease are in the bin dir.
func (t *hostTree) installed() bool {
	if ok, _ := t.ours(); !ok {
		return false
	}
	for _, f := range []string{cniapi.PluginType, cniapi.PluginType + cniapi.LeaseSuffix, cniapi.PluginType + cniapi.KubeconfigSuffix} {
		if _, err := os.Stat(filepath.Join(t.binDir, f)); err != nil {
			return false
		}
	}
	return true
}

// waitInstalled waits until the agent has installed the plugin.
func (t *hostTree) waitInstalled(ctx context.Context, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	for !t.installed() {
		select {
		case <-ctx.Done():
			ls, _ := os.ReadDir(t.confDir)
			lb, _ := os.ReadDir(t.binDir)
			return fmt.Errorf("the agent did not install the plugin within %v (conf dir %v, bin dir %v)", within, names(ls), names(lb))
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

func names(es []os.DirEntry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// createDaemonSet creates the agent's DaemonSet (deploy/'s name, namespace
// and selector; it selects every node, this one too). Nothing runs it: the
// soak starts the agent itself.
func createDaemonSet(ctx context.Context, env *e2eenv.Env) error {
	labels := map[string]string{"app": daemonSetName}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: daemonSetName, Namespace: e2eenv.AgentNamespace, Labels: labels},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "ambientd", Image: "ambientd"}}},
			},
		},
	}
	_, err := env.CP.Admin.AppsV1().DaemonSets(ds.Namespace).Create(ctx, ds, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

// deleteDaemonSet deletes it (after the agent stopped: a later run starts
// from nothing).
func deleteDaemonSet(ctx context.Context, env *e2eenv.Env) error {
	err := env.CP.Admin.AppsV1().DaemonSets(e2eenv.AgentNamespace).Delete(ctx, daemonSetName, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// primaryRewritten: the primary CNI rewrites its own conflist (at boot, on
// upgrade: a new revision of the same chain), removing the file and
// writing it again after a moment, or in place (truncated, then written).
// The agent's owned conflist must follow: the fault lasts until the
// runtime's config is ours with the new revision (followed), and a
// follow slower than followBound while the agent ran is a violation.
func primaryRewritten(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	t := s.host
	orig, err := os.ReadFile(t.primary)
	if err != nil {
		return "", err
	}
	var conf map[string]any
	if err := json.Unmarshal(orig, &conf); err != nil {
		return "", err
	}
	rev := s.primaryRev.Add(1)
	conf[revisionKey] = rev
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return "", err
	}
	how := "in place"
	if rng.IntN(2) == 0 {
		gap := jitter(rng, 0, 2*time.Second)
		how = fmt.Sprintf("removed for %v", gap.Round(time.Millisecond))
		if err := os.Remove(t.primary); err != nil {
			return "", err
		}
		time.Sleep(gap)
	}
	// os.WriteFile truncates and writes: a reader may see it empty or
	// half-written meanwhile, as with a primary's installer.
	if err := os.WriteFile(t.primary, b, 0o644); err != nil {
		return "", err
	}
	written := time.Now()
	want := fmt.Sprintf("%q: %d", revisionKey, rev)
	took, err := s.waitConflist(ctx, func(data []byte) bool { return strings.Contains(string(data), want) })
	if err != nil {
		return "", fmt.Errorf("revision %d, %s: %w", rev, how, err)
	}
	s.judgeFollow("the primary's revision "+fmt.Sprint(rev), written, took)
	return fmt.Sprintf("revision %d, %s; followed in %v", rev, how, took.Round(time.Millisecond)), nil
}

// ownedConflistDeleted: another component deletes the agent's owned
// conflist (a node cleanup, a primary's installer that claims the conf
// dir): the runtime reads the primary alone, without our plugin, until the
// agent writes it again. The fault lasts until then.
func ownedConflistDeleted(ctx context.Context, s *soak, rng *rand.Rand) (string, error) {
	rc, err := cniinstall.RuntimeConfig(s.host.confDir)
	if err != nil {
		return "", err
	}
	if rc.Path == s.host.primary {
		return "", fmt.Errorf("the runtime's config is the primary's, not ours (the agent's install is not in place)")
	}
	if err := os.Remove(rc.Path); err != nil {
		return "", err
	}
	removed := time.Now()
	took, err := s.waitConflist(ctx, nil)
	if err != nil {
		return "", fmt.Errorf("%s deleted: %w", filepath.Base(rc.Path), err)
	}
	s.judgeFollow(filepath.Base(rc.Path)+" deleted", removed, took)
	return fmt.Sprintf("%s deleted, back in %v", filepath.Base(rc.Path), took.Round(time.Millisecond)), nil
}

// waitConflist waits until the runtime's config runs our plugin and its
// text passes ok (nil: any), and returns how long that took.
func (s *soak) waitConflist(ctx context.Context, ok func([]byte) bool) (time.Duration, error) {
	from := time.Now()
	ctx, cancel := context.WithTimeout(ctx, conflistFaultWait)
	defer cancel()
	for {
		if ours, data := s.host.ours(); ours && (ok == nil || ok(data)) {
			return time.Since(from), nil
		}
		select {
		case <-ctx.Done():
			ls, _ := os.ReadDir(s.host.confDir)
			return 0, fmt.Errorf("the runtime's config was not ours again within %v (conf dir %v)", conflistFaultWait, names(ls))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// The installer's loop guard (docs/install.md, "What install-cni does on
// a node"; --cni-repair-limit and --cni-repair-window at their defaults):
// above repairLimit rewrites in repairWindow it takes another component to
// be fighting it and repairs with a doubling delay, 1 s up to a minute.
const (
	repairLimit    = 5
	repairWindow   = time.Minute
	repairMaxDelay = time.Minute
)

// conflistFaults change the runtime's config.
var conflistFaults = []string{"owned-conflist-deleted", "primary-rewritten"}

// followAllowed is the bound of a follow of the change at: followBound,
// plus the loop guard's delay when the soak's own conflist faults of the
// last repairWindow (this one included) are more than repairLimit: the
// agent is entitled to take them for a fight (a generous bound: the
// delay the guard reaches after that many repairs in a row).
func (s *soak) followAllowed(at time.Time) time.Duration {
	n := 0
	for _, k := range conflistFaults {
		n += s.rec.startedBetween(k, at.Add(-repairWindow), at)
	}
	if n <= repairLimit {
		return followBound
	}
	delay := repairMaxDelay
	if over := n - repairLimit; over < 7 {
		delay = min(repairMaxDelay, time.Second<<over)
	}
	return followBound + delay
}

// judgeFollow: the agent's installer must repair the runtime's config
// within the bound (followAllowed) of the change, unless the soak had the
// agent out in that time (its restart repairs it).
func (s *soak) judgeFollow(what string, at time.Time, took time.Duration) {
	bound := s.followAllowed(at)
	if took <= bound || s.rec.agentOutBetween(at, at.Add(took)) {
		return
	}
	s.rec.violation(violation{At: at, Kind: kindNotFollowed,
		Detail: fmt.Sprintf("%s: the runtime's config ran our plugin with it only %v later, the agent running all along (bound %v)", what, took.Round(time.Millisecond), bound)})
}

// conflistInFlux: a fault that changes the runtime's config was in flight
// at some moment between from and to (the runtime may have read a config
// without our plugin, or none).
func (s *soak) conflistInFlux(from, to time.Time) bool {
	return slices.ContainsFunc(conflistFaults, func(k string) bool { return s.rec.overlaps(k, from, to) })
}

// waitRuntimeConfig waits (up to 30 s) until the conf dir holds a config
// the runtime can use. While a primary rewrites its file the agent
// withdraws its copy with it, and a DEL then has no config to run (the
// pod's lease and rules would stay): the kubelet retries a sandbox's
// teardown until its DEL works, and the soak waits before its DELs as
// that retry would.
func (t *hostTree) waitRuntimeConfig(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		if _, err := cniinstall.RuntimeConfig(t.confDir); err == nil || ctx.Err() != nil {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}
