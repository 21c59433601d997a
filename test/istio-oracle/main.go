// Command istio-oracle renders ambientd's sidecar-mode golden files with
// Istio's own code (see README.md): for every case of the table in cases.go it
// injects the input pod with Istio's injector (kube-inject's code path, CNI
// mode), runs Istio's CNI plugin (plugin.CmdAdd, iptables dry run) on the
// injected pod, and, for the pods the plugin programs, records the rules
// Istio's sidecar rule builders produce (iptables-restore input per family,
// native nftables transaction) and the routes and addresses Istio's tproxy
// package adds.
//
//	istio-oracle -out DIR      regenerate DIR; exit 1 if anything changed
//	  -run NAME                only the cases whose name contains NAME
//	  -manifests FILE          also write what `profile=ambient` renders
//	  -cni DIR                 where the Cni component's manifests go (cni.go)
//
// It runs in a user + network namespace of its own (it re-executes itself),
// so nothing it does can reach the host's network stack.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"istio.io/istio/pkg/log"
)

const sandboxEnv = "ISTIO_ORACLE_SANDBOX"

func main() {
	out := flag.String("out", "testdata/sidecar", "directory of the golden files (one .txtar per case)")
	only := flag.String("run", "", "only cases whose name contains this (no stale-file check)")
	manifests := flag.String("manifests", "", "also write every object `profile=ambient` renders to this file (not a golden)")
	cniDir := flag.String("cni", "testdata/cni", "directory of the rendered Cni component (Istio's node agent) the switch tests deploy")
	flag.Parse()
	if os.Getenv(sandboxEnv) != "1" {
		os.Exit(reexecSandboxed())
	}
	if err := run(*out, *only, *manifests, *cniDir); err != nil {
		fmt.Fprintln(os.Stderr, "istio-oracle:", err)
		os.Exit(1)
	}
}

// reexecSandboxed runs this program again as root of a new user namespace
// with a new network namespace, and with ENABLE_NATIVE_SIDECARS=true, which
// Istio reads at package init (the webhook's choice on Kubernetes ≥ 1.29).
func reexecSandboxed() int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "istio-oracle:", err)
		return 1
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), sandboxEnv+"=1", "ENABLE_NATIVE_SIDECARS=true")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
	}
	if err := cmd.Run(); err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "istio-oracle: start sandbox:", err)
		return 1
	}
	return 0
}

func run(outDir, only, manifestsPath, cniDir string) error {
	_ = log.Configure(quietLogOptions())
	// The local API stand-in listens on loopback of this fresh netns.
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("set lo up in the sandbox: %w", err)
	}
	injectors := map[profile]*injector{}
	for _, p := range []profile{profileCNI, profileNoCNI} {
		if injectors[p], err = newInjector(p); err != nil {
			return err
		}
	}
	if manifestsPath != "" {
		f, err := os.Create(manifestsPath)
		if err != nil {
			return err
		}
		if err := injectors[profileCNI].writeManifests(f); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	work, err := os.MkdirTemp("", "istio-oracle-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	h, err := newCNIHarness(work)
	if err != nil {
		return err
	}
	defer h.Close()

	files := map[string][]byte{}
	for _, c := range cases {
		if only != "" && !strings.Contains(c.name, only) {
			continue
		}
		c = c.withDefaults()
		ar, err := renderCase(c, injectors[c.profile], h)
		if err != nil {
			return fmt.Errorf("case %s: %w", c.name, err)
		}
		files[c.name+".txtar"] = ar
	}
	if err := checkIstioGoldens(files); err != nil {
		return err
	}
	err = writeAll(outDir, files, only == "")
	if only != "" {
		return err
	}
	cni, cerr := renderCNI()
	if cerr == nil {
		cerr = writeAll(cniDir, cni, false)
	}
	return errors.Join(err, cerr)
}

// renderCase runs one case through injector, plugin and rule builders and
// returns its txtar archive.
func renderCase(c oracleCase, inj *injector, h *cniHarness) ([]byte, error) {
	var a archive
	a.add("case", caseHeader(c))
	input := c.inputPod()
	in, err := yaml.Marshal(input)
	if err != nil {
		return nil, err
	}
	a.add("input.yaml", string(in))

	injected, warnings, injErr := inj.inject(input)
	var injNote strings.Builder
	fmt.Fprintf(&injNote, "profile: %s\n", c.profile)
	after := map[string]string{}
	for k, v := range c.afterAnnotations {
		after[k] = v
	}
	if injErr != nil {
		// The injector refuses the annotation: inject without the case's
		// annotations and set them on the injected pod instead (as if
		// edited after admission), so the plugin's own check is on record.
		fmt.Fprintf(&injNote, "injector error: %v\n", injErr)
		fmt.Fprintf(&injNote, "the pod below was injected without the case's annotations; they were set afterwards\n")
		bare := c
		bare.annotations = nil
		if injected, warnings, err = inj.inject(bare.inputPod()); err != nil {
			return nil, fmt.Errorf("inject without annotations: %w", err)
		}
		for k, v := range c.annotations {
			after[k] = v
		}
	}
	for _, w := range warnings {
		fmt.Fprintf(&injNote, "warning: %s\n", w)
	}
	injectedSidecar := hasContainer(injected, "istio-proxy")
	fmt.Fprintf(&injNote, "istio-proxy injected: %t\n", injectedSidecar)
	for _, k := range sortedKeys(after) {
		fmt.Fprintf(&injNote, "after injection: annotation %s=%q\n", k, after[k])
		setOrDelete(&injected.Annotations, k, after[k])
	}
	for _, k := range sortedKeys(c.afterLabels) {
		fmt.Fprintf(&injNote, "after injection: label %s=%q\n", k, c.afterLabels[k])
		setOrDelete(&injected.Labels, k, c.afterLabels[k])
	}
	a.add("injector.txt", injNote.String())
	out, err := yaml.Marshal(injected)
	if err != nil {
		return nil, err
	}
	a.add("injected.yaml", string(out))

	var pod *corev1.Pod
	if !c.notKubernetes {
		pod = injected
	}
	res, err := h.cmdAdd(c, pod, "/proc/self/ns/net")
	if err != nil {
		return nil, err
	}
	var pl strings.Builder
	fmt.Fprintf(&pl, "outcome: %s\n", res.outcome)
	if res.err != "" {
		fmt.Fprintf(&pl, "error: %s\n", res.err)
	}
	for _, r := range res.reasons {
		fmt.Fprintf(&pl, "log: %s\n", r)
	}
	a.add("plugin.txt", pl.String())
	if res.outcome != "programmed" {
		return a.bytes(), nil
	}

	redirect, err := redirectFor(injected)
	if err != nil {
		return nil, fmt.Errorf("plugin programmed the pod but NewRedirect fails: %w", err)
	}
	fields, err := redirectFields(redirect)
	if err != nil {
		return nil, err
	}
	var rd strings.Builder
	for _, kv := range fields {
		fmt.Fprintf(&rd, "%s=%s\n", kv[0], kv[1])
	}
	a.add("redirect.txt", rd.String())

	cfg, err := configFor(redirect, c.family)
	if err != nil {
		return nil, err
	}
	v4In, v6In, err := iptablesRules(cfg)
	if err != nil {
		return nil, fmt.Errorf("iptables: %w", err)
	}
	// The plugin's own dry run (through Program) must equal the builder run
	// through this oracle's Redirect→Config mapping: proof that the mapping
	// (also used for nftables, which has no dry run) is Program's.
	if got := v4In + v6In; got != res.rules {
		return nil, fmt.Errorf("plugin dry run and capture differ:\n--- plugin\n%s\n--- capture\n%s", res.rules, got)
	}
	a.add("iptables.v4", v4In)
	if v6In != "" {
		a.add("iptables.v6", v6In)
	}
	cfgNft, err := configFor(redirect, c.family)
	if err != nil {
		return nil, err
	}
	nft, err := nftRules(cfgNft)
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	a.add("nft.txt", nft)
	routes, err := routeState(cfg)
	if err != nil {
		return nil, fmt.Errorf("routes: %w", err)
	}
	if routes != "" {
		a.add("routes.txt", routes)
	}
	return a.bytes(), nil
}

func caseHeader(c oracleCase) string {
	var b strings.Builder
	fmt.Fprintf(&b, "name: %s\n", c.name)
	fmt.Fprintf(&b, "doc: %s\n", c.doc)
	fmt.Fprintf(&b, "family: %s\n", c.family)
	switch c.family {
	case v4:
		b.WriteString("pod addresses: 10.244.0.17/24\n")
	case v6:
		b.WriteString("pod addresses: fd00:10:244::11/64\n")
	case dual:
		b.WriteString("pod addresses: 10.244.0.17/24 fd00:10:244::11/64\n")
	}
	if c.notKubernetes {
		b.WriteString("cni args: no K8S_POD_NAMESPACE/K8S_POD_NAME\n")
	}
	return b.String()
}

func hasContainer(pod *corev1.Pod, name string) bool {
	for _, c := range append(append([]corev1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
		if c.Name == name {
			return true
		}
	}
	return false
}

func setOrDelete(m *map[string]string, k, v string) {
	if v == "" {
		delete(*m, k)
		return
	}
	if *m == nil {
		*m = map[string]string{}
	}
	(*m)[k] = v
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// archive is a txtar archive (golang.org/x/tools/txtar format): a comment,
// then "-- name --" lines each followed by that file's text.
type archive struct{ b bytes.Buffer }

func (a *archive) add(name, text string) {
	if a.b.Len() == 0 {
		a.b.WriteString("Generated by test/istio-oracle (make istio-oracle) from Istio's own code. Do not edit.\n")
	}
	fmt.Fprintf(&a.b, "-- %s --\n", name)
	a.b.WriteString(text)
	if text != "" && !strings.HasSuffix(text, "\n") {
		a.b.WriteString("\n")
	}
}

func (a *archive) bytes() []byte { return a.b.Bytes() }

// writeAll writes the archives to dir and reports every file that was added,
// changed or (when stale is true) is no longer generated; any such file is an
// error after the write, so `make istio-oracle` fails until they are committed.
func writeAll(dir string, files map[string][]byte, stale bool) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var changed []string
	for name, data := range files {
		path := filepath.Join(dir, name)
		old, err := os.ReadFile(path)
		if err == nil && bytes.Equal(old, data) {
			continue
		}
		changed = append(changed, name)
		if err := os.WriteFile(path, data, 0o644); err != nil {
			return err
		}
	}
	if stale {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if _, ok := files[e.Name()]; !ok && strings.HasSuffix(e.Name(), ".txtar") {
				changed = append(changed, e.Name()+" (removed)")
				if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
					return err
				}
			}
		}
	}
	sort.Strings(changed)
	fmt.Printf("istio-oracle: %d cases, %d changed\n", len(files), len(changed))
	if len(changed) > 0 {
		return fmt.Errorf("golden files differ from the committed ones (now rewritten; review and commit): %s",
			strings.Join(changed, ", "))
	}
	return nil
}
