package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/nodeagent/shutdownrule"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/ztunnelproto"
)

// runFlags are the agent's settings; each flag has an environment variable
// that sets it when the flag is not given (flags win). Flags bind straight
// into the Config of the package they set (node: daemon.Config with its
// agent.Config; rules: iptables.Config), which validates it; the fields
// here are the process's own settings and the flags whose text is parsed
// into a Config after the flag set (lists, uids, octal bits).
type runFlags struct {
	kubeconfig, logLevel, excludeNamespaces, handover string
	capturableRuntimeHandlers                         string
	ztunnelSocketMode, kubeletUID, ztunnelAllowedUIDs string
	installCNI                                        bool
	kubeQPS                                           float64
	kubeBurst, gcPercent                              int
	install                                           installFlags
	node                                              daemon.Config
	rules                                             iptables.Config
}

// envOf maps the run flags to their environment variables (parseFlags).
var envOf = flagEnv{
	"kubeconfig":                  "KUBECONFIG",
	"node-name":                   "NODE_NAME",
	"ztunnel-socket":              "ZTUNNEL_UDS_ADDRESS",
	"cni-socket":                  "AMBIENTD_CNI_SOCKET",
	"health-addr":                 "AMBIENTD_HEALTH_ADDR",
	"metrics-addr":                "AMBIENTD_METRICS_ADDR",
	"pprof-addr":                  "AMBIENTD_PPROF_ADDR",
	"istio-metrics":               "AMBIENTD_ISTIO_METRICS",
	"host-proc":                   "AMBIENTD_HOST_PROC",
	"iptables":                    "AMBIENTD_IPTABLES",
	"exclude-namespaces":          admission.EnvExcludeNamespaces,
	"system-namespace":            admission.EnvSystemNamespace,
	"capturable-runtime-handlers": "AMBIENTD_CAPTURABLE_RUNTIME_HANDLERS",
	"dns-capture":                 "AMBIENTD_DNS_CAPTURE",
	"ipv6":                        "AMBIENTD_IPV6",
	"install-cni":                 "AMBIENTD_INSTALL_CNI",
	"fail-pending":                "AMBIENTD_FAIL_PENDING",
	"pod-lookup-timeout":          "AMBIENTD_POD_LOOKUP_TIMEOUT",
	"retry-base-delay":            "AMBIENTD_RETRY_BASE_DELAY",
	"retry-max-delay":             "AMBIENTD_RETRY_MAX_DELAY",
	"log-level":                   "AMBIENTD_LOG_LEVEL",
	"gc-percent":                  "AMBIENTD_GC_PERCENT",
	"kube-qps":                    "AMBIENTD_KUBE_QPS",
	"kube-burst":                  "AMBIENTD_KUBE_BURST",
	"verify-interval":             "AMBIENTD_VERIFY_INTERVAL",
	"run-dir":                     "AMBIENTD_RUN_DIR",
	"ztunnel-socket-mode":         "AMBIENTD_ZTUNNEL_SOCKET_MODE",
	"pod-condition-type":          admission.EnvConditionType,
	"kubelet-uid":                 "AMBIENTD_KUBELET_UID",
	"admin-socket":                "AMBIENTD_ADMIN_SOCKET",
	"iptables-lock-wait":          "AMBIENTD_IPTABLES_LOCK_WAIT",
	"workers":                     "AMBIENTD_WORKERS",
	"max-parallel-adds":           "AMBIENTD_MAX_PARALLEL_ADDS",
	"ztunnel-allowed-uids":        "AMBIENTD_ZTUNNEL_ALLOWED_UIDS",
	"handover":                    "AMBIENTD_HANDOVER",
	"ztunnel-grace":               "AMBIENTD_ZTUNNEL_GRACE",
	"ztunnel-probe-interval":      "AMBIENTD_ZTUNNEL_PROBE_INTERVAL",
}

// Kubernetes client rate limits: client-go's defaults (5 QPS, burst 10) are
// for controllers with a steady trickle; a node agent has bursts — a
// restart rebuilding every pod, a node full of pods created at once, each
// with a status patch and maybe a lookup GET.
const (
	defaultKubeQPS   = 20
	defaultKubeBurst = 50
)

func parseRunFlags(args []string, getenv func(string) string) (runFlags, error) {
	var f runFlags
	fs, nodeReady, sidecarSettings := f.flagSet()
	a, n := &f.node.Agent, &f.node
	if err := parseFlags(fs, args, getenv, envOf, installEnvOf, nodeReadyEnvOf, sidecarEnvOf); err != nil {
		return f, err
	}
	if fs.NArg() > 0 {
		return f, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	// What the flags' text sets only once parsed, and the settings two
	// parts share (one flag each).
	a.Policy.ExcludeNamespaces = f.excluded()
	a.Policy.CapturableRuntimeHandlers = splitList(f.capturableRuntimeHandlers)
	n.CNIConfDir = f.install.confDir
	f.rules.IPv6, f.rules.StateDir, f.rules.HostProc = a.IPv6, a.RunDir, a.HostProc
	f.rules.KubeletUID = f.kubeletUIDValue()
	nr, err := nodeReady(a.NodeName)
	if err != nil {
		return f, err
	}
	n.NodeReady = nr
	if n.Sidecar, err = sidecarSettings(); err != nil {
		return f, err
	}
	if err := f.validate(); err != nil {
		return f, err
	}
	n.ZtunnelSocketMode, _ = f.socketMode()   // validated
	n.ZtunnelAllowedUIDs, _ = f.allowedUIDs() // validated
	return f, nil
}

// flagSet binds the run flags to f's fields (with the defaults of each
// package's Config) and returns the functions that build the node
// readiness and sidecar configs once the set is parsed.
func (f *runFlags) flagSet() (*flag.FlagSet, func(nodeName string) (nodeready.Config, error), func() (daemon.SidecarConfig, error)) {
	f.node.Agent = agent.DefaultConfig()
	a, n := &f.node.Agent, &f.node
	fs := flag.NewFlagSet("ambientd run", flag.ContinueOnError)

	fs.SetOutput(os.Stderr)
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; empty = in-cluster config")
	fs.StringVar(&a.NodeName, "node-name", "", "this node's name (required)")
	fs.StringVar(&n.ZtunnelSocket, "ztunnel-socket", ztunnelproto.DefaultSocketPath, "Unix socket ztunnel connects to")
	fs.StringVar(&n.CNISocket, "cni-socket", cniapi.DefaultSocketPath, "Unix socket the CNI plugin calls")
	fs.StringVar(&n.AdminSocket, "admin-socket", admin.DefaultSocketPath, "Unix socket the status command asks (root only)")
	fs.StringVar(&n.HealthAddr, "health-addr", ":8000", "address of /healthz and /readyz")
	fs.StringVar(&n.MetricsAddr, "metrics-addr", ":15014", "address of /metrics")
	fs.BoolVar(&n.IstioMetrics, "istio-metrics", true, "also export Istio's istio-cni metric names (istio_cni_plugin_requests_total, nodeagent_reconcile_events_total, ztunnel_connected, istio_cni_install_ready, istio_cni_installs_total) beside ambientd's, so alerts written for istio-cni keep working (docs/metrics.md, \"Istio's names\")")
	fs.StringVar(&n.PprofAddr, "pprof-addr", "", "address of Go's profiling endpoints (/debug/pprof/); empty = off. They show the agent's memory and goroutines to whoever reaches them: bind to loopback (127.0.0.1:6060)")
	fs.StringVar(&a.HostProc, "host-proc", a.HostProc, "host /proc, scanned for running pods' network namespaces")
	fs.StringVar((*string)(&f.rules.Mode), "iptables", string(iptables.ModeAuto), "rules backend: auto, legacy, nft (iptables-nft) or nftables (native, over netlink)")
	fs.DurationVar(&f.rules.LockWait, "iptables-lock-wait", 10*time.Second, "how long iptables-restore waits for the host-wide xtables lock (legacy iptables; rounded up to whole seconds) before the rule step fails and is retried")
	fs.StringVar(&f.excludeNamespaces, "exclude-namespaces", strings.Join(a.Policy.ExcludeNamespaces, ","), "comma-separated namespaces never enrolled")
	fs.StringVar(&f.capturableRuntimeHandlers, "capturable-runtime-handlers", strings.Join(a.Policy.CapturableRuntimeHandlers, ","), "comma-separated runtime handlers (a RuntimeClass's handler; \"default\" for pods without a RuntimeClass) whose pods' traffic the in-pod rules capture; a mesh pod under any other (gVisor's runsc, Kata's kata-*) has its CNI ADD refused and is never reported in the mesh (docs/agent.md)")
	fs.StringVar(&a.Policy.SystemNamespace, "system-namespace", a.Policy.SystemNamespace, "namespace of the mesh's own pods: only there are app=ztunnel and app=ambientd pods kept out of the mesh")
	fs.BoolVar(&a.DNSCapture, "dns-capture", a.DNSCapture, "capture DNS to ztunnel by default, as Istio does since 1.25 (pod annotation ambient.istio.io/dns-capture overrides)")
	fs.BoolVar(&a.IPv6, "ipv6", a.IPv6, "also capture IPv6 (harmless in IPv4-only pods); with --ipv6=false a pod with an IPv6 address fails its CNI ADD rather than run with IPv6 uncaptured")
	fs.DurationVar(&a.VerifyInterval, "verify-interval", a.VerifyInterval, "period of the drift pass that reads back enrolled pods' rules and the host rules and repairs drift (jittered ±10%; 0 = off)")
	fs.StringVar(&a.RunDir, "run-dir", a.RunDir, "the agent's run directory (tmpfs): holds the pod state file (netns path and inode per pod), tried before the /proc scan on restart")
	fs.StringVar(&f.kubeletUID, "kubelet-uid", "", "uid of the kubelet, whose probes the nftables backend's host SNAT matches (meta skuid); empty = found by scanning --host-proc for kubelet, kubelite or k3s")
	fs.StringVar(&f.ztunnelSocketMode, "ztunnel-socket-mode", "0600", "permission bits of the ztunnel socket (octal); widen it (e.g. 0660) for a non-root ztunnel")
	fs.StringVar(&f.ztunnelAllowedUIDs, "ztunnel-allowed-uids", "0", "comma-separated uids ztunnel may connect as; any other process that reaches the ztunnel socket (it would receive every pod's network namespace) is refused, logged and counted (SO_PEERCRED)")
	fs.BoolVar(&f.installCNI, "install-cni", false, "install the CNI plugin into the host's bin dir and config, keep it there, report it in readiness (see docs/install.md)")
	fs.StringVar(&f.handover, "handover", string(iptables.SuccessorNone), "the node agent that takes the node over when this one uninstalls (not at an upgrade or restart): none (pods keep their rules as they are), istio (Istio's istio-cni with its chart defaults: iptables), istio-nftables (Istio's native nftables mode), or the backend an agent is pinned to (legacy, nft, nftables); before uninstalling, every enrolled pod's rules are moved to the backend that agent will use (docs/install.md, \"Switching\"). Needs --install-cni")
	fs.BoolVar(&a.FailPending, "fail-pending", false, "fail the CNI ADD of a pod ztunnel has not acked (default: the pod starts with rules in place, held until ztunnel takes it)")
	fs.DurationVar(&a.PodLookupTimeout, "pod-lookup-timeout", a.PodLookupTimeout, "how long a CNI ADD waits for an unknown pod to appear in the API (the informer first, then direct GETs with capped exponential backoff)")
	fs.DurationVar(&a.RetryBaseDelay, "retry-base-delay", a.RetryBaseDelay, "first backoff of a pod whose reconcile failed (pending pods are also retried on every ztunnel snapshot ack)")
	fs.DurationVar(&a.RetryMaxDelay, "retry-max-delay", a.RetryMaxDelay, "cap of the per-pod exponential backoff")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.IntVar(&f.gcPercent, "gc-percent", defaultGCPercent, "the Go garbage collector's target (GOGC): the heap may grow this many percent over the live heap before a collection; lower costs CPU, saves memory on every node (0: leave the Go runtime's, i.e. GOGC or 100)")
	fs.Float64Var(&f.kubeQPS, "kube-qps", defaultKubeQPS, "Kubernetes API requests per second the agent may make (client-go rate limit)")
	fs.IntVar(&f.kubeBurst, "kube-burst", defaultKubeBurst, "Kubernetes API request burst above --kube-qps")
	fs.IntVar(&a.Workers, "workers", a.Workers, "pod syncs run at once from the workqueue (informer events, retries)")
	fs.IntVar(&a.MaxParallelAdds, "max-parallel-adds", a.MaxParallelAdds, "CNI ADDs enrolling at once; more wait within their deadline")
	f.install.register(fs)
	fs.StringVar(&a.PodConditionType, "pod-condition-type", a.PodConditionType, "pod condition the agent maintains on the pods it enrolls (name it in spec.readinessGates)")
	fs.DurationVar(&n.ZtunnelProbeInterval, "ztunnel-probe-interval", ztunnel.DefaultProbeInterval, "how long a ztunnel connection may be idle before the agent probes it (a Del of a uid no pod has, which ztunnel acks and which changes nothing): a ztunnel that does not answer within 5s is hung, its connection dropped and its pods not ready after --ztunnel-grace (reason ZtunnelNotResponding); 1s to 5m")
	fs.DurationVar(&a.ZtunnelGrace, "ztunnel-grace", a.ZtunnelGrace, "how long the node may be without a ztunnel that acked its snapshot before every enabled pod's condition turns False (reason ZtunnelUnavailable) so its Services stop sending it traffic nothing proxies; 0 = never (docs/readiness.md)")
	return fs, nodeReadyFlags(fs), sidecarFlags(fs)
}

// kubeletUIDValue is --kubelet-uid as the rule manager takes it (nil: scan,
// or not a uid: validate refuses it).
func (f runFlags) kubeletUIDValue() *uint32 {
	u, err := strconv.ParseUint(f.kubeletUID, 10, 32)
	if err != nil {
		return nil
	}
	v := uint32(u)
	return &v
}

// flagOf names the flag that sets each daemon.Config field its Validate
// may report (agent.SettingError; the agent's own as "Agent.<field>").
var flagOf = map[string]string{
	"ZtunnelSocket":                          "ztunnel-socket",
	"CNISocket":                              "cni-socket",
	"CNIConfDir":                             "cni-conf-dir",
	"AdminSocket":                            "admin-socket",
	"HealthAddr":                             "health-addr",
	"MetricsAddr":                            "metrics-addr",
	"PprofAddr":                              "pprof-addr",
	"ZtunnelProbeInterval":                   "ztunnel-probe-interval",
	"Agent.NodeName":                         "node-name",
	"Agent.HostProc":                         "host-proc",
	"Agent.RunDir":                           "run-dir",
	"Agent.PodConditionType":                 "pod-condition-type",
	"Agent.Policy.ExcludeNamespaces":         "exclude-namespaces",
	"Agent.Policy.SystemNamespace":           "system-namespace",
	"Agent.Policy.CapturableRuntimeHandlers": "capturable-runtime-handlers",
	"Agent.PodLookupTimeout":                 "pod-lookup-timeout",
	"Agent.RetryBaseDelay":                   "retry-base-delay",
	"Agent.RetryMaxDelay":                    "retry-max-delay",
	"Agent.ZtunnelGrace":                     "ztunnel-grace",
	"Agent.VerifyInterval":                   "verify-interval",
	"Agent.Workers":                          "workers",
	"Agent.MaxParallelAdds":                  "max-parallel-adds",
}

// validate checks the settings in a fixed order: the process's own, then
// the daemon's Config with the agent's (each package validates its own,
// reported under the flag that sets the field), then the rules'.
func (f runFlags) validate() error {
	if f.kubeletUID != "" && f.kubeletUIDValue() == nil {
		return fmt.Errorf("--kubelet-uid %q: must be a numeric uid", f.kubeletUID)
	}
	if f.gcPercent < 0 {
		return fmt.Errorf("--gc-percent %d: want 0 (the Go runtime's) or more", f.gcPercent)
	}
	if err := f.node.Validate(); err != nil {
		var se *agent.SettingError
		if errors.As(err, &se) && flagOf[se.Field] != "" {
			return fmt.Errorf("--%s %w", flagOf[se.Field], se.Err)
		}
		return err
	}
	if err := f.rules.Validate(); err != nil {
		return fmt.Errorf("--iptables: %w", err)
	}
	if s, err := iptables.ParseSuccessor(f.handover); err != nil {
		return fmt.Errorf("--handover: %w", err)
	} else if s != iptables.SuccessorNone && !f.installCNI {
		return fmt.Errorf("--handover %s needs --install-cni: only the installer's shutdown rule tells an uninstall from an upgrade", f.handover)
	}
	if _, err := f.install.config(f.node.CNISocket, f.excluded()); f.installCNI && err != nil {
		return err
	}
	if f.rules.LockWait < time.Second || f.rules.LockWait > time.Minute {
		return fmt.Errorf("--iptables-lock-wait %v: want between 1s and 1m", f.rules.LockWait)
	}
	if _, err := f.socketMode(); err != nil {
		return err
	}
	if _, err := f.allowedUIDs(); err != nil {
		return err
	}
	if f.kubeQPS <= 0 || f.kubeBurst < 1 {
		return fmt.Errorf("--kube-qps %v / --kube-burst %d: must be positive", f.kubeQPS, f.kubeBurst)
	}
	if _, err := parseLevel(f.logLevel); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	return nil
}

// socketMode parses --ztunnel-socket-mode: octal permission bits, owner
// read-write at least (the agent is the owner), nothing beyond 0777.
func (f runFlags) socketMode() (os.FileMode, error) {
	m, err := strconv.ParseUint(f.ztunnelSocketMode, 8, 32)
	if err != nil || m > 0o777 || m&0o600 != 0o600 {
		return 0, fmt.Errorf("--ztunnel-socket-mode %q: want octal permission bits including owner rw (e.g. 0600, 0660)", f.ztunnelSocketMode)
	}
	return os.FileMode(m), nil
}

// allowedUIDs parses --ztunnel-allowed-uids: one or more numeric uids.
func (f runFlags) allowedUIDs() ([]uint32, error) {
	var uids []uint32
	for _, p := range strings.Split(f.ztunnelAllowedUIDs, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		u, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("--ztunnel-allowed-uids %q: %q is not a numeric uid", f.ztunnelAllowedUIDs, p)
		}
		uids = append(uids, uint32(u))
	}
	if len(uids) == 0 {
		return nil, fmt.Errorf("--ztunnel-allowed-uids %q: want at least one uid (0: root)", f.ztunnelAllowedUIDs)
	}
	return uids, nil
}

func (f runFlags) excluded() []string { return splitList(f.excludeNamespaces) }

// splitList reads a comma-separated flag: its items trimmed, empty ones
// dropped.
func splitList(s string) []string {
	var out []string
	for _, n := range strings.Split(s, ",") {
		if n = strings.TrimSpace(n); n != "" {
			out = append(out, n)
		}
	}
	return out
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	return l, err
}

// runCmd runs the node agent until SIGINT/SIGTERM.
func runCmd(args []string) int {
	f, err := parseRunFlags(args, os.Getenv)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	level, _ := parseLevel(f.logLevel)
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if f.installCNI {
		// First, before anything can fail — a setting refused below
		// included, as long as the install settings themselves are
		// usable: an agent that crash-loops still renews the install
		// lease, so the plugin keeps failing closed (docs/install.md,
		// "An uninstall nobody finished").
		if lerr := writeStartLease(f, log); lerr != nil {
			log.Warn("cannot write the install lease", "error", lerr)
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ambientd run: %v\n", err)
		reportStartFailure(f, err, log)
		return 2
	}
	if f.gcPercent > 0 {
		debug.SetGCPercent(f.gcPercent)
	}
	if f.node.PprofAddr == "" {
		// Nobody can read a heap profile: stop sampling allocations. The
		// samples' stacks fill a 1.4 MiB hash table page by page, and the
		// agent runs on every node (docs/scale.md, "Memory").
		runtime.MemProfileRate = 0
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, f, log); err != nil {
		log.Error("ambientd run failed", "error", err)
		return 1
	}
	return 0
}

// reportStartFailure names the refused setting in a node Event, when the
// agent's node and client configuration are usable: a crash-looping agent
// says why where an operator looks first.
func reportStartFailure(f runFlags, why error, log *slog.Logger) {
	if f.node.Agent.NodeName == "" {
		return
	}
	restCfg, err := kubeConfig(f.kubeconfig)
	if err != nil {
		return
	}
	restCfg.UserAgent = "ambientd/" + version
	client, err := kube.NewForConfig(restCfg)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := kube.ReportStartFailure(ctx, client, f.node.Agent.NodeName, "ambientd", why.Error()); err != nil {
		log.Warn("cannot record the refused setting in a node Event", "error", err)
	}
}

// writeStartLease renews the install lease, and the plugin's kubeconfig
// when the agent's client configuration can be read, at process start.
func writeStartLease(f runFlags, log *slog.Logger) error {
	cfg, err := f.leaseConfig()
	if err != nil {
		return err
	}
	if restCfg, err := kubeConfig(f.kubeconfig); err == nil {
		if cfg.Credentials, err = f.pluginCredentials(restCfg); err != nil {
			log.Warn("cannot make the plugin's credentials", "error", err)
		}
	}
	inst, err := cniinstall.New(cfg, log)
	if err != nil {
		return err
	}
	return inst.WriteLease()
}

// leaseConfig is the installer's config with what the install lease tells
// the plugin for while no agent answers: the agent's DaemonSet and its
// enrollment policy.
func (f runFlags) leaseConfig() (cniinstall.Config, error) {
	cfg, err := f.install.config(f.node.CNISocket, f.excluded())
	if err != nil {
		return cfg, err
	}
	p := f.node.Agent.Policy
	cfg.DaemonSetNamespace, cfg.DaemonSetName = f.install.namespace, f.install.daemonSet
	cfg.Policy = &cniapi.LeasePolicy{
		ExcludeNamespaces: f.excluded(), SystemNamespace: p.SystemNamespace,
		ZtunnelLabels: p.ZtunnelLabels, SelfLabels: p.SelfLabels, Sidecar: !f.node.Sidecar.Disabled,
	}
	return cfg, nil
}

// pluginCredentials is what the installer writes as the plugin's
// kubeconfig: tokens minted for --cni-plugin-service-account, or the
// agent's own credentials.
func (f runFlags) pluginCredentials(restCfg *rest.Config) (func() ([]byte, error), error) {
	if f.install.pluginServiceAccount == "" {
		return kube.PluginKubeconfig(restCfg), nil
	}
	p, err := kube.NewPluginToken(restCfg, f.install.namespace, f.install.pluginServiceAccount, f.install.pluginTokenTTL)
	if err != nil {
		return nil, err
	}
	return p.Kubeconfig, nil
}

// defaultGCPercent halves the collector's headroom (Go's default is 100):
// the agent's live heap is small (about 15 MiB at 1,000 pods) and it runs
// on every node, so the headroom is most of what it holds; the extra
// collections cost little CPU (docs/scale.md, "Memory").
const defaultGCPercent = 50

// run wires the pieces; all behaviour lives in nodeagent/.
func run(ctx context.Context, f runFlags, log *slog.Logger) error {
	restCfg, err := kubeConfig(f.kubeconfig)
	if err != nil {
		return err
	}
	restCfg.UserAgent = "ambientd/" + version
	restCfg.QPS, restCfg.Burst = float32(f.kubeQPS), f.kubeBurst
	requests := kube.NewRequestMetrics()
	restCfg.Wrap(requests.Wrap)
	client, err := kube.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	// The backend choice is persisted in the run dir (tmpfs: it survives
	// restarts, not reboots — as the rules themselves).
	rules, err := iptables.NewManager(ctx, f.rules, log.With("component", "iptables"))
	if err != nil {
		return fmt.Errorf("--iptables %s: %w", f.rules.Mode, err)
	}
	if err := rules.EnsureHostRules(ctx); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	cfg := f.node
	cfg.Version = version
	cfg.RequestMetrics = requests
	// With --install-cni the installer's own check (our entry last in the
	// config the runtime uses) feeds /readyz and the node condition;
	// without it the daemon reads the conf dir itself.
	var ci *daemon.InstallCNI
	if f.installCNI {
		icfg, _ := f.leaseConfig() // validated
		if icfg.Credentials, err = f.pluginCredentials(restCfg); err != nil {
			return err
		}
		successor, _ := iptables.ParseSuccessor(f.handover) // validated
		ilog := log.With("component", "cni-install")
		inst, err := cniinstall.New(icfg, ilog)
		if err != nil {
			return err
		}
		ci = daemon.NewInstallCNI(inst, shutdownrule.New(client, f.install.namespace, f.install.daemonSet, f.node.Agent.NodeName), rules, successor, ilog)
		defer ci.Finish()
		cfg.Agent.HandOver = ci.HandOver
		cfg.PluginInstalled = ci.Check
		cfg.InstallLease = ci.LeaseErr
		cfg.Components = append(cfg.Components, ci.Component())
	}
	node, err := daemon.New(cfg, client, rules, log)
	if err != nil {
		return err
	}
	if ci != nil {
		ci.CountInstalls(node.Istio())
	}
	log.Info("ambientd starting", "version", version, "node", cfg.Agent.NodeName, "ztunnel_socket", cfg.ZtunnelSocket, "cni_socket", cfg.CNISocket, "iptables", rules.Mode())
	return node.Run(ctx)
}

func kubeConfig(path string) (*rest.Config, error) {
	if path == "" {
		c, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig is empty and in-cluster config failed: %w", err)
		}
		return c, nil
	}
	c, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", path, err)
	}
	return c, nil
}
