package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/cniinstall"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/nodeagent/shutdownrule"
	"github.com/ambientd/ambientd/ztunnelproto"
)

// runFlags are the agent's settings; each flag has an environment variable
// that sets it when the flag is not given (flags win).
type runFlags struct {
	kubeconfig, nodeName, ztunnelSocket, cniSocket  string
	adminSocket                                     string
	healthAddr, metricsAddr, hostProc, iptablesMode string
	pprofAddr                                       string
	excludeNamespaces, logLevel, runDir             string
	handover                                        string
	systemNamespace                                 string
	podConditionType, ztunnelSocketMode             string
	kubeletUID, ztunnelAllowedUIDs                  string
	verifyInterval, ztunnelGrace                    time.Duration
	dnsCapture, ipv6, installCNI, failPending       bool
	podLookupTimeout, retryBase, retryMax           time.Duration
	iptablesLockWait                                time.Duration
	kubeQPS                                         float64
	kubeBurst, workers, maxParallelAdds             int
	gcPercent                                       int
	install                                         installFlags
	nodeReady                                       nodeready.Config
	sidecar                                         daemon.SidecarConfig
}

// envOf maps the run flags to their environment variables (parseFlags).
var envOf = flagEnv{
	"kubeconfig":           "KUBECONFIG",
	"node-name":            "NODE_NAME",
	"ztunnel-socket":       "ZTUNNEL_UDS_ADDRESS",
	"cni-socket":           "AMBIENTD_CNI_SOCKET",
	"health-addr":          "AMBIENTD_HEALTH_ADDR",
	"metrics-addr":         "AMBIENTD_METRICS_ADDR",
	"pprof-addr":           "AMBIENTD_PPROF_ADDR",
	"host-proc":            "AMBIENTD_HOST_PROC",
	"iptables":             "AMBIENTD_IPTABLES",
	"exclude-namespaces":   admission.EnvExcludeNamespaces,
	"system-namespace":     admission.EnvSystemNamespace,
	"dns-capture":          "AMBIENTD_DNS_CAPTURE",
	"ipv6":                 "AMBIENTD_IPV6",
	"install-cni":          "AMBIENTD_INSTALL_CNI",
	"fail-pending":         "AMBIENTD_FAIL_PENDING",
	"pod-lookup-timeout":   "AMBIENTD_POD_LOOKUP_TIMEOUT",
	"retry-base-delay":     "AMBIENTD_RETRY_BASE_DELAY",
	"retry-max-delay":      "AMBIENTD_RETRY_MAX_DELAY",
	"log-level":            "AMBIENTD_LOG_LEVEL",
	"gc-percent":           "AMBIENTD_GC_PERCENT",
	"kube-qps":             "AMBIENTD_KUBE_QPS",
	"kube-burst":           "AMBIENTD_KUBE_BURST",
	"verify-interval":      "AMBIENTD_VERIFY_INTERVAL",
	"run-dir":              "AMBIENTD_RUN_DIR",
	"ztunnel-socket-mode":  "AMBIENTD_ZTUNNEL_SOCKET_MODE",
	"pod-condition-type":   admission.EnvConditionType,
	"kubelet-uid":          "AMBIENTD_KUBELET_UID",
	"admin-socket":         "AMBIENTD_ADMIN_SOCKET",
	"iptables-lock-wait":   "AMBIENTD_IPTABLES_LOCK_WAIT",
	"workers":              "AMBIENTD_WORKERS",
	"max-parallel-adds":    "AMBIENTD_MAX_PARALLEL_ADDS",
	"ztunnel-allowed-uids": "AMBIENTD_ZTUNNEL_ALLOWED_UIDS",
	"handover":             "AMBIENTD_HANDOVER",
	"ztunnel-grace":        "AMBIENTD_ZTUNNEL_GRACE",
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
	def := agent.DefaultConfig()
	fs := flag.NewFlagSet("ambientd run", flag.ContinueOnError)
	fs.SetOutput(os.Stderr)
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; empty = in-cluster config")
	fs.StringVar(&f.nodeName, "node-name", "", "this node's name (required)")
	fs.StringVar(&f.ztunnelSocket, "ztunnel-socket", ztunnelproto.DefaultSocketPath, "Unix socket ztunnel connects to")
	fs.StringVar(&f.cniSocket, "cni-socket", cniapi.DefaultSocketPath, "Unix socket the CNI plugin calls")
	fs.StringVar(&f.adminSocket, "admin-socket", admin.DefaultSocketPath, "Unix socket the status command asks (root only)")
	fs.StringVar(&f.healthAddr, "health-addr", ":8000", "address of /healthz and /readyz")
	fs.StringVar(&f.metricsAddr, "metrics-addr", ":15014", "address of /metrics")
	fs.StringVar(&f.pprofAddr, "pprof-addr", "", "address of Go's profiling endpoints (/debug/pprof/); empty = off. They show the agent's memory and goroutines to whoever reaches them: bind to loopback (127.0.0.1:6060)")
	fs.StringVar(&f.hostProc, "host-proc", def.HostProc, "host /proc, scanned for running pods' network namespaces")
	fs.StringVar(&f.iptablesMode, "iptables", "auto", "rules backend: auto, legacy, nft (iptables-nft) or nftables (native, over netlink)")
	fs.DurationVar(&f.iptablesLockWait, "iptables-lock-wait", 10*time.Second, "how long iptables-restore waits for the host-wide xtables lock (legacy iptables; rounded up to whole seconds) before the rule step fails and is retried")
	fs.StringVar(&f.excludeNamespaces, "exclude-namespaces", strings.Join(def.Policy.ExcludeNamespaces, ","), "comma-separated namespaces never enrolled")
	fs.StringVar(&f.systemNamespace, "system-namespace", def.Policy.SystemNamespace, "namespace of the mesh's own pods: only there are app=ztunnel and app=ambientd pods kept out of the mesh")
	fs.BoolVar(&f.dnsCapture, "dns-capture", def.DNSCapture, "capture DNS to ztunnel by default, as Istio does since 1.25 (pod annotation ambient.istio.io/dns-capture overrides)")
	fs.BoolVar(&f.ipv6, "ipv6", def.IPv6, "also capture IPv6 (harmless in IPv4-only pods); with --ipv6=false a pod with an IPv6 address fails its CNI ADD rather than run with IPv6 uncaptured")
	fs.DurationVar(&f.verifyInterval, "verify-interval", def.VerifyInterval, "period of the drift pass that reads back enrolled pods' rules and the host rules and repairs drift (jittered ±10%; 0 = off)")
	fs.StringVar(&f.runDir, "run-dir", def.RunDir, "the agent's run directory (tmpfs): holds the pod state file (netns path and inode per pod), tried before the /proc scan on restart")
	fs.StringVar(&f.kubeletUID, "kubelet-uid", "", "uid of the kubelet, whose probes the nftables backend's host SNAT matches (meta skuid); empty = found by scanning --host-proc for kubelet, kubelite or k3s")
	fs.StringVar(&f.ztunnelSocketMode, "ztunnel-socket-mode", "0600", "permission bits of the ztunnel socket (octal); widen it (e.g. 0660) for a non-root ztunnel")
	fs.StringVar(&f.ztunnelAllowedUIDs, "ztunnel-allowed-uids", "0", "comma-separated uids ztunnel may connect as; any other process that reaches the ztunnel socket (it would receive every pod's network namespace) is refused, logged and counted (SO_PEERCRED)")
	fs.BoolVar(&f.installCNI, "install-cni", false, "install the CNI plugin into the host's bin dir and config, keep it there, report it in readiness (see docs/install.md)")
	fs.StringVar(&f.handover, "handover", string(iptables.SuccessorNone), "the node agent that takes the node over when this one uninstalls (not at an upgrade or restart): none (pods keep their rules as they are), istio (Istio's istio-cni with its chart defaults: iptables), istio-nftables (Istio's native nftables mode), or the backend an agent is pinned to (legacy, nft, nftables); before uninstalling, every enrolled pod's rules are moved to the backend that agent will use (docs/install.md, \"Switching\"). Needs --install-cni")
	fs.BoolVar(&f.failPending, "fail-pending", false, "fail the CNI ADD of a pod ztunnel has not acked (default: the pod starts with rules in place, held until ztunnel takes it)")
	fs.DurationVar(&f.podLookupTimeout, "pod-lookup-timeout", def.PodLookupTimeout, "how long a CNI ADD waits for an unknown pod to appear in the API (the informer first, then direct GETs with capped exponential backoff)")
	fs.DurationVar(&f.retryBase, "retry-base-delay", def.RetryBaseDelay, "first backoff of a pod whose reconcile failed (pending pods are also retried on every ztunnel snapshot ack)")
	fs.DurationVar(&f.retryMax, "retry-max-delay", def.RetryMaxDelay, "cap of the per-pod exponential backoff")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.IntVar(&f.gcPercent, "gc-percent", defaultGCPercent, "the Go garbage collector's target (GOGC): the heap may grow this many percent over the live heap before a collection; lower costs CPU, saves memory on every node (0: leave the Go runtime's, i.e. GOGC or 100)")
	fs.Float64Var(&f.kubeQPS, "kube-qps", defaultKubeQPS, "Kubernetes API requests per second the agent may make (client-go rate limit)")
	fs.IntVar(&f.kubeBurst, "kube-burst", defaultKubeBurst, "Kubernetes API request burst above --kube-qps")
	fs.IntVar(&f.workers, "workers", def.Workers, "pod syncs run at once from the workqueue (informer events, retries)")
	fs.IntVar(&f.maxParallelAdds, "max-parallel-adds", def.MaxParallelAdds, "CNI ADDs enrolling at once; more wait within their deadline")
	f.install.register(fs)
	fs.StringVar(&f.podConditionType, "pod-condition-type", def.PodConditionType, "pod condition the agent maintains on the pods it enrolls (name it in spec.readinessGates)")
	fs.DurationVar(&f.ztunnelGrace, "ztunnel-grace", def.ZtunnelGrace, "how long the node may be without a ztunnel that acked its snapshot before every enabled pod's condition turns False (reason ZtunnelUnavailable) so its Services stop sending it traffic nothing proxies; 0 = never (docs/readiness.md)")
	nodeReady := nodeReadyFlags(fs)
	sidecarSettings := sidecarFlags(fs)
	if err := parseFlags(fs, args, getenv, envOf, installEnvOf, nodeReadyEnvOf, sidecarEnvOf); err != nil {
		return f, err
	}
	if fs.NArg() > 0 {
		return f, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	nr, err := nodeReady(f.nodeName)
	if err != nil {
		return f, err
	}
	f.nodeReady = nr
	if f.sidecar, err = sidecarSettings(); err != nil {
		return f, err
	}
	return f, f.validate()
}

// kubeletUIDValue is --kubelet-uid as the rule manager takes it (nil: scan).
func (f runFlags) kubeletUIDValue() *uint32 {
	if f.kubeletUID == "" {
		return nil
	}
	u, _ := strconv.ParseUint(f.kubeletUID, 10, 32) // validated
	v := uint32(u)
	return &v
}

// namedValue is a flag's value with the flag's name, for checks that range
// over several flags in a fixed order.
type namedValue[T any] struct {
	flag  string
	value T
}

func (f runFlags) validate() error {
	if f.kubeletUID != "" {
		if _, err := strconv.ParseUint(f.kubeletUID, 10, 32); err != nil {
			return fmt.Errorf("--kubelet-uid %q: must be a numeric uid", f.kubeletUID)
		}
	}
	if f.gcPercent < 0 {
		return fmt.Errorf("--gc-percent %d: want 0 (the Go runtime's) or more", f.gcPercent)
	}
	if f.nodeName == "" {
		return errors.New("--node-name (or NODE_NAME) is required")
	}
	if errs := validation.IsDNS1123Subdomain(f.nodeName); len(errs) > 0 {
		return fmt.Errorf("--node-name %q: %s", f.nodeName, strings.Join(errs, "; "))
	}
	// Slices, not maps: with several bad flags, the one reported is the
	// same on every run.
	for _, p := range []namedValue[string]{{"--ztunnel-socket", f.ztunnelSocket}, {"--cni-socket", f.cniSocket}, {"--host-proc", f.hostProc}, {"--cni-conf-dir", f.install.confDir}, {"--run-dir", f.runDir}, {"--admin-socket", f.adminSocket}} {
		if !filepath.IsAbs(p.value) {
			return fmt.Errorf("%s %q: must be an absolute path", p.flag, p.value)
		}
	}
	if f.ztunnelSocket == f.cniSocket || f.adminSocket == f.cniSocket || f.adminSocket == f.ztunnelSocket {
		return fmt.Errorf("--ztunnel-socket %q, --cni-socket %q and --admin-socket %q must differ", f.ztunnelSocket, f.cniSocket, f.adminSocket)
	}
	if fi, err := os.Stat(f.hostProc); err != nil || !fi.IsDir() {
		return fmt.Errorf("--host-proc %q: not a readable directory: %v", f.hostProc, err)
	}
	for _, a := range []namedValue[string]{{"--health-addr", f.healthAddr}, {"--metrics-addr", f.metricsAddr}, {"--pprof-addr", f.pprofAddr}} {
		if a.value == "" && a.flag == "--pprof-addr" {
			continue
		}
		if _, _, err := net.SplitHostPort(a.value); err != nil {
			return fmt.Errorf("%s %q: want host:port: %w", a.flag, a.value, err)
		}
	}
	if errs := validation.IsQualifiedName(f.podConditionType); len(errs) > 0 {
		return fmt.Errorf("--pod-condition-type %q: %s", f.podConditionType, strings.Join(errs, "; "))
	}
	if _, err := iptables.ParseMode(f.iptablesMode); err != nil {
		return fmt.Errorf("--iptables: %w", err)
	}
	if s, err := iptables.ParseSuccessor(f.handover); err != nil {
		return fmt.Errorf("--handover: %w", err)
	} else if s != iptables.SuccessorNone && !f.installCNI {
		return fmt.Errorf("--handover %s needs --install-cni: only the installer's shutdown rule tells an uninstall from an upgrade", f.handover)
	}
	for _, n := range f.excluded() {
		if errs := validation.IsDNS1123Label(n); len(errs) > 0 {
			return fmt.Errorf("--exclude-namespaces: %q: %s", n, strings.Join(errs, "; "))
		}
	}
	if errs := validation.IsDNS1123Label(f.systemNamespace); len(errs) > 0 {
		return fmt.Errorf("--system-namespace %q: %s", f.systemNamespace, strings.Join(errs, "; "))
	}
	if _, err := f.install.config(f.cniSocket, f.excluded()); f.installCNI && err != nil {
		return err
	}
	if f.iptablesLockWait < time.Second || f.iptablesLockWait > time.Minute {
		return fmt.Errorf("--iptables-lock-wait %v: want between 1s and 1m", f.iptablesLockWait)
	}
	if f.podLookupTimeout <= 0 || f.podLookupTimeout > 5*time.Minute {
		return fmt.Errorf("--pod-lookup-timeout %v: want between 0 and 5m", f.podLookupTimeout)
	}
	if f.retryBase <= 0 {
		return fmt.Errorf("--retry-base-delay %v: must be positive", f.retryBase)
	}
	if f.retryMax < f.retryBase {
		return fmt.Errorf("--retry-max-delay %v: must not be below --retry-base-delay %v", f.retryMax, f.retryBase)
	}
	if f.ztunnelGrace < 0 {
		return fmt.Errorf("--ztunnel-grace %v: want 0 (never) or more", f.ztunnelGrace)
	}
	if f.verifyInterval < 0 || (f.verifyInterval > 0 && f.verifyInterval < 100*time.Millisecond) {
		return fmt.Errorf("--verify-interval %v: want 0 (off) or at least 100ms", f.verifyInterval)
	}
	if _, err := f.socketMode(); err != nil {
		return err
	}
	if _, err := f.allowedUIDs(); err != nil {
		return err
	}
	if f.workers < 1 || f.workers > 256 || f.maxParallelAdds < 1 || f.maxParallelAdds > 1024 {
		return fmt.Errorf("--workers %d / --max-parallel-adds %d: want 1..256 / 1..1024", f.workers, f.maxParallelAdds)
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

func (f runFlags) excluded() []string {
	var out []string
	for _, n := range strings.Split(f.excludeNamespaces, ",") {
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
		return 2
	}
	if f.gcPercent > 0 {
		debug.SetGCPercent(f.gcPercent)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, f, log); err != nil {
		log.Error("ambientd run failed", "error", err)
		return 1
	}
	return 0
}

// writeStartLease renews the install lease at process start.
func writeStartLease(f runFlags, log *slog.Logger) error {
	cfg, err := f.install.config(f.cniSocket, f.excluded())
	if err != nil {
		return err
	}
	inst, err := cniinstall.New(cfg, log)
	if err != nil {
		return err
	}
	return inst.WriteLease()
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
	client, err := kube.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	// The backend choice is persisted in the run dir (tmpfs: it survives
	// restarts, not reboots — as the rules themselves).
	rulesCfg := iptables.Config{IPv6: f.ipv6, Mode: iptables.Mode(f.iptablesMode),
		StateDir: f.runDir, HostProc: f.hostProc, KubeletUID: f.kubeletUIDValue(), LockWait: f.iptablesLockWait}
	rules, err := iptables.NewManager(ctx, rulesCfg, log.With("component", "iptables"))
	if err != nil {
		return fmt.Errorf("--iptables %s: %w", f.iptablesMode, err)
	}
	if err := rules.EnsureHostRules(ctx); err != nil {
		return fmt.Errorf("host probe rules: %w", err)
	}
	ac := agent.DefaultConfig()
	ac.NodeName = f.nodeName
	ac.Policy.ExcludeNamespaces = f.excluded()
	ac.Policy.SystemNamespace = f.systemNamespace
	ac.DNSCapture = f.dnsCapture
	ac.HostProc = f.hostProc
	ac.FailPending = f.failPending
	ac.PodLookupTimeout = f.podLookupTimeout
	ac.RetryBaseDelay, ac.RetryMaxDelay = f.retryBase, f.retryMax
	ac.PodConditionType = f.podConditionType
	ac.VerifyInterval, ac.IPv6, ac.RunDir = f.verifyInterval, f.ipv6, f.runDir
	ac.ZtunnelGrace = f.ztunnelGrace
	ac.Workers, ac.MaxParallelAdds = f.workers, f.maxParallelAdds
	mode, _ := f.socketMode()         // validated
	ztunnelUIDs, _ := f.allowedUIDs() // validated
	// With --install-cni the installer's own check (our entry last in the
	// config the runtime uses) feeds /readyz and the node condition;
	// without it the daemon reads the conf dir itself.
	var pluginInstalled func() error
	var first []daemon.Component
	if f.installCNI {
		cfg, _ := f.install.config(f.cniSocket, f.excluded()) // validated
		successor, _ := iptables.ParseSuccessor(f.handover)   // validated
		ilog := log.With("component", "cni-install")
		inst, err := cniinstall.New(cfg, ilog)
		if err != nil {
			return err
		}
		ci := daemon.NewInstallCNI(inst, shutdownrule.New(client, f.install.namespace, f.install.daemonSet, f.nodeName), rules, successor, ilog)
		defer ci.Finish()
		ac.HandOver = ci.HandOver
		pluginInstalled = ci.Check
		first = append(first, ci.Component())
	}
	node, err := daemon.New(daemon.Config{
		Agent:              ac,
		ZtunnelSocketMode:  mode,
		ZtunnelAllowedUIDs: ztunnelUIDs,
		ZtunnelSocket:      f.ztunnelSocket,
		CNISocket:          f.cniSocket,
		HealthAddr:         f.healthAddr,
		MetricsAddr:        f.metricsAddr,
		PprofAddr:          f.pprofAddr,
		NodeReady:          f.nodeReady,
		CNIConfDir:         f.install.confDir,
		PluginInstalled:    pluginInstalled,
		Components:         first,
		AdminSocket:        f.adminSocket,
		Version:            version,
		Sidecar:            f.sidecar,
	}, client, rules, log)
	if err != nil {
		return err
	}
	log.Info("ambientd starting", "version", version, "node", f.nodeName, "ztunnel_socket", f.ztunnelSocket, "cni_socket", f.cniSocket, "iptables", rules.Mode())
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
