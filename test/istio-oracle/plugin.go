package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/containernetworking/cni/pkg/skel"
	corev1 "k8s.io/api/core/v1"

	"istio.io/istio/cni/pkg/constants"
	"istio.io/istio/cni/pkg/plugin"
	"istio.io/istio/pkg/log"
	"istio.io/istio/tools/common/config"
	"istio.io/istio/tools/istio-iptables/pkg/dependencies"
)

// cniHarness runs Istio's real CNI plugin entry point (plugin.CmdAdd) for a
// sidecar pod: the plugin reads its kubeconfig from cni_agent_run_dir, GETs
// the pod from a local API stand-in that serves exactly the injected pod, and
// programs iptables through Istio's dry-run dependencies
// (DRY_RUN_FILE_PATH), so nothing reaches a kernel.
type cniHarness struct {
	dir string
	srv *httptest.Server

	mu  sync.Mutex
	pod *corev1.Pod
}

func newCNIHarness(dir string) (*cniHarness, error) {
	h := &cniHarness{dir: dir}
	h.srv = httptest.NewServer(http.HandlerFunc(h.serve))
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: %s
contexts:
- name: local
  context:
    cluster: local
    user: cni
current-context: local
users:
- name: cni
  user:
    token: oracle
`, h.srv.URL)
	if err := os.WriteFile(filepath.Join(dir, constants.CNIPluginKubeconfName), []byte(kubeconfig), 0o600); err != nil {
		h.srv.Close()
		return nil, err
	}
	return h, nil
}

func (h *cniHarness) Close() { h.srv.Close() }

// serve answers GET /api/v1/namespaces/NS/pods/NAME with the current pod and
// 403 for everything else, so an unexpected request fails the run loudly
// rather than retrying for 30 s.
func (h *cniHarness) serve(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	pod := h.pod
	h.mu.Unlock()
	if pod != nil && r.Method == http.MethodGet &&
		r.URL.Path == "/api/v1/namespaces/"+pod.Namespace+"/pods/"+pod.Name {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(pod)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusForbidden)
	fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,"message":"oracle: unexpected %s %s"}`,
		r.Method, r.URL.Path)
}

// addResult is what Istio's plugin did with one CNI ADD.
type addResult struct {
	outcome string   // programmed | skipped | error
	err     string   // CmdAdd's error, for outcome error
	reasons []string // the plugin's own log lines that explain a skip or error
	rules   string   // the iptables-restore input it produced (dry run), both families
}

// cmdAdd runs plugin.CmdAdd for the pod (nil: not a Kubernetes pod) with
// the pod's netns (the oracle's own throwaway one).
func (h *cniHarness) cmdAdd(c oracleCase, pod *corev1.Pod, netns string) (addResult, error) {
	h.mu.Lock()
	h.pod = pod
	h.mu.Unlock()

	conf := map[string]any{
		"cniVersion":         "1.0.0",
		"name":               "istio-cni",
		"type":               "istio-cni",
		"plugin_log_level":   "debug",
		"cni_agent_run_dir":  h.dir,
		"ambient_enabled":    false,
		"exclude_namespaces": []string{"kube-system"},
		"pod_namespace":      "istio-system",
		"native_nftables":    false,
		"prevResult": map[string]any{
			"cniVersion": "1.0.0",
			"interfaces": []any{map[string]any{"name": "eth0", "sandbox": netns}},
			"ips":        []any{map[string]any{"address": "10.244.0.17/24", "interface": 0}},
		},
	}
	stdin, err := json.Marshal(conf)
	if err != nil {
		return addResult{}, err
	}
	cniArgs := "IgnoreUnknown=1"
	if !c.notKubernetes {
		cniArgs += fmt.Sprintf(";K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=0123456789abcdef;K8S_POD_UID=00000000-0000-0000-0000-000000000001",
			c.namespace, c.podName)
	}
	args := &skel.CmdArgs{
		ContainerID: "0123456789abcdef",
		Netns:       netns,
		IfName:      "eth0",
		Args:        cniArgs,
		StdinData:   stdin,
	}

	dryRun := filepath.Join(h.dir, "dry-run.txt")
	logFile := filepath.Join(h.dir, "plugin-log.json")
	stdout := filepath.Join(h.dir, "stdout.json")
	for _, f := range []string{dryRun, logFile, stdout} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			return addResult{}, err
		}
	}
	// Program reads the pod's addresses inside the netns to decide IPv6.
	config.LocalIPAddrs = podAddrs(c.family)
	os.Setenv(dependencies.DryRunFilePath.Name, dryRun)
	defer os.Unsetenv(dependencies.DryRunFilePath.Name)

	// The plugin logs JSON to stderr (and prints its result to stdout): send
	// both to files for the run. Configure logging as doAddRun does, first,
	// so skips decided before doAddRun are logged to this case's file too.
	restore, err := redirectStdio(logFile, stdout)
	if err != nil {
		return addResult{}, err
	}
	_ = log.Configure(plugin.GetLoggingOptions(&plugin.Config{CNIAgentRunDir: h.dir, PluginLogLevel: "debug"}))
	addErr := plugin.CmdAdd(args)
	restore()
	_ = log.Configure(quietLogOptions())

	res := addResult{}
	rules, err := os.ReadFile(dryRun)
	if err != nil {
		return res, err
	}
	res.rules = dryRunRestoreInput(string(rules))
	if res.reasons, err = pluginDecisions(logFile); err != nil {
		return res, err
	}
	switch {
	case addErr != nil:
		res.outcome, res.err = "error", addErr.Error()
	case res.rules != "":
		res.outcome = "programmed"
	default:
		res.outcome = "skipped"
	}
	return res, nil
}

// dryRunRestoreInput keeps the iptables-restore input lines of Istio's dry-run
// file and drops the discrete commands it records (iptables-save probes), as
// Istio's own golden test does.
func dryRunRestoreInput(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(s, "\n") {
		if line == "" || line == "iptables-save" || line == "ip6tables-save" {
			continue
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}

// pluginDecisions returns the plugin's log messages that say why it skipped
// a pod or failed (Istio's words, so phase 2 can log the same facts).
func pluginDecisions(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var entry struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &entry) != nil {
			continue
		}
		m := entry.Msg
		if strings.Contains(m, "due to dry run mode") {
			continue // the oracle's dry run, not a decision about the pod
		}
		if strings.Contains(m, "excluded") || strings.Contains(m, "skipping") ||
			strings.Contains(m, "Not a kubernetes pod") || strings.Contains(m, "bad params") ||
			strings.Contains(m, "cannot parse") {
			out = append(out, entry.Level+": "+m)
		}
	}
	return out, sc.Err()
}

// redirectStdio points os.Stderr and os.Stdout at files until restore.
func redirectStdio(stderrPath, stdoutPath string) (restore func(), err error) {
	errF, err := os.OpenFile(stderrPath, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return nil, err
	}
	outF, err := os.OpenFile(stdoutPath, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		errF.Close()
		return nil, err
	}
	oldErr, oldOut := os.Stderr, os.Stdout
	os.Stderr, os.Stdout = errF, outF
	return func() {
		os.Stderr, os.Stdout = oldErr, oldOut
		errF.Close()
		outF.Close()
	}, nil
}

// quietLogOptions keeps Istio's logging of the oracle's own calls (rule
// builders, injector) out of the way; failures come back as errors.
func quietLogOptions() *log.Options {
	o := log.DefaultOptions()
	o.OutputPaths = []string{"stderr"}
	o.SetDefaultOutputLevel(log.OverrideScopeName, log.NoneLevel)
	return o
}
