package nodeenv

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/test/infra/build"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// CgroupPrefix starts the name of kubelet's cgroup root, a top-level cgroup
// in every hierarchy: CgroupPrefix + "<pid of the outer process>-<random>".
// hack/leftovers.sh looks for it.
const CgroupPrefix = "ambientd-e2e-node-"

// envCgroupRoot passes the cgroup root's name from the outer process (which
// removes it after the run, whatever happened) to the one in the node netns.
const envCgroupRoot = "AMBIENTD_NODE_CGROUP_ROOT"

// Options configure the node. The zero value is a working node.
type Options struct {
	// NodeName is the Node's name (default: this machine's hostname, which
	// resolves to a local address, so the apiserver reaches kubelet for
	// `kubectl logs` the way it does on a real node).
	NodeName string
	// NodeIP is put on an interface (node0) of the node netns and given to
	// kubelet as --node-ip (default 10.99.0.1).
	NodeIP netip.Addr
	// PodSubnet is host-local's range (default 10.244.0.0/24).
	PodSubnet netip.Prefix
	// Bridge is the bridge plugin's bridge (default ambnode0).
	Bridge string
	// RegisterTaints are set by kubelet when it registers the Node
	// (registerWithTaints), e.g. the agent's startup taint
	// cni.istio.io/not-ready. Start waits for Ready, not for these to go.
	RegisterTaints []corev1.Taint
	// KubeletPort is kubelet's serving port (default 20250; any port works,
	// the node netns is ours).
	KubeletPort int
	// Log receives progress messages (default os.Stderr).
	Log io.Writer
	// PIDNamespace gives the node a PID namespace of its own, whose pid 1
	// is in the node's network namespace, as on a machine (pidns.go): for
	// node agents that read the host's namespaces through /proc/1, as
	// Istio's does.
	PIDNamespace bool
}

func (o *Options) defaults() error {
	if o.NodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("node name: %w", err)
		}
		o.NodeName = strings.ToLower(h)
	}
	if !o.NodeIP.IsValid() {
		o.NodeIP = netip.MustParseAddr("10.99.0.1")
	}
	if !o.PodSubnet.IsValid() {
		o.PodSubnet = netip.MustParsePrefix("10.244.0.0/24")
	}
	if o.Bridge == "" {
		o.Bridge = "ambnode0"
	}
	if o.KubeletPort == 0 {
		o.KubeletPort = 20250
	}
	if o.Log == nil {
		o.Log = os.Stderr
	}
	return nil
}

// Node is a running real node: e2eenv's control plane plus containerd,
// kubelet, kube-controller-manager and kube-scheduler.
type Node struct {
	Env  *e2eenv.Env
	Bins build.Binaries
	Name string
	IP   netip.Addr
	Dir  string // <Env.Dir>/node

	// ContainerdAddress is containerd's socket (ctr --address).
	ContainerdAddress string
	// ContainerdState is containerd's state dir.
	ContainerdState string
	// NetnsDir holds the pods' network namespaces (CNI_NETNS paths): the
	// standard /var/run/netns, a tmpfs in the node's mount namespace.
	NetnsDir string
	// CNIBinDir and CNIConfDir are the node's CNI dirs under the work dir;
	// in the node's mount namespace they are also at the standard
	// StdCNIBinDir and StdCNIConfDir, which containerd uses. IPAMDir is
	// host-local's lease dir.
	CNIBinDir, CNIConfDir, IPAMDir string
	Bridge                         string
	PodSubnet                      netip.Prefix
	// PodLogsDir is kubelet's container log dir.
	PodLogsDir string
	// StaticPodDir is kubelet's static pod directory (WriteStaticPod).
	StaticPodDir string

	Containerd, Kubelet, ControllerManager, Scheduler *e2eenv.Process

	// BringUp is from starting containerd to the Node being Ready without
	// the not-ready taint.
	BringUp time.Duration

	log            io.Writer
	kubeletPort    int
	kubeletHealthz int
	registerTaints []corev1.Taint
	cgroupRoot     string
	cgroups        []cgroupMount
}

// Main is a TestMain for real-node test packages: Program running the
// package's tests, with the node handed to use first.
func Main(m *testing.M, opts Options, use func(*Node)) {
	os.Exit(Program(opts, func(_ context.Context, n *Node) int {
		use(n)
		return m.Run()
	}))
}

// Program runs run with a started node and returns the exit code for
// os.Exit. Outside a node netns it builds what is missing, saves the
// machine-wide sysctls kubelet changes, re-runs the program in a fresh node
// netns (e2eenv.RunIsolated) and afterwards, whatever happened there, removes
// kubelet's cgroup tree and restores the sysctls. Inside, it starts the
// control plane and the node, calls run, and closes both.
func Program(opts Options, run func(ctx context.Context, n *Node) int) int {
	if err := opts.defaults(); err != nil {
		fmt.Fprintf(os.Stderr, "nodeenv: %v\n", err)
		return 1
	}
	if !e2eenv.InNodeNetns() {
		return outer(opts.Log)
	}
	if os.Getenv(envPIDNSInit) == "1" {
		return pidNamespaceInit(opts.Log)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// The mount namespace first: e2eenv's pod cgroups then use the same
	// /sys/fs/cgroup as kubelet. (Inside the node's own PID namespace it is
	// prepared already, by the run that made the namespace.)
	mounts, inPIDNS, err := pidNamespaceMounts()
	if err == nil && !inPIDNS {
		mounts, err = hostCgroupMounts("/proc/1/mountinfo")
		if err == nil {
			err = prepareMountNamespace(mounts)
		}
		if err == nil && opts.PIDNamespace {
			stop() // the namespace's init gets the signals and forwards them
			return enterPIDNamespace(mounts, opts.Log)
		}
	}
	if err != nil {
		fmt.Fprintf(opts.Log, "nodeenv: %v\n", err)
		return 1
	}
	env, err := e2eenv.Start(ctx, e2eenv.Options{NodeName: opts.NodeName, SkipNode: true, Log: opts.Log,
		APIServerArgs: apiServerArgs(), ServingIPs: apiServerServingIPs(opts.NodeIP.String())})
	if err != nil {
		fmt.Fprintf(opts.Log, "nodeenv: start control plane: %v\n", err)
		return 1
	}
	code := 0
	n, err := start(ctx, env, mounts, opts)
	if err != nil {
		fmt.Fprintf(opts.Log, "nodeenv: start node: %v\n", err)
		code = 1
	} else {
		code = run(ctx, n)
	}
	if n != nil {
		if err := n.Close(); err != nil {
			fmt.Fprintf(opts.Log, "nodeenv: close node: %v\n", err)
			code = max(code, 1)
		}
	}
	if err := env.Close(); err != nil {
		fmt.Fprintf(opts.Log, "nodeenv: close environment: %v\n", err)
		code = max(code, 1)
	}
	return code
}

// outer is Program's part in the machine's namespaces.
func outer(log io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if _, err := build.Ensure(ctx, build.Node, build.Options{Log: log, Name: "the command you ran", MustExist: build.CheckOnly()}); err != nil {
		fmt.Fprintf(log, "build: %v\n", err)
		return 1
	}
	if build.CheckOnly() {
		fmt.Fprintf(log, "build: everything is in place (%s=1: not starting)\n", build.EnvCheckOnly)
		return 0
	}
	mounts, err := hostCgroupMounts("/proc/1/mountinfo")
	if err != nil {
		fmt.Fprintf(log, "nodeenv: cgroups: %v\n", err)
		return 1
	}
	// One real node at a time on a machine: runs share the mount points and
	// the sysctls (one run restoring them, or removing a mount point it
	// created, under another's feet would break that one).
	unlock, err := lockMachine(ctx, log)
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		return 1
	}
	defer unlock()
	saved, err := saveSysctls(kubeletSysctls)
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		return 1
	}
	pathsBefore := existingPaths(hardcodedPaths)
	created, err := makeMountPoints()
	code := 1
	if err == nil {
		cgroupRoot := CgroupPrefix + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano()%1e6, 10)
		os.Setenv(envCgroupRoot, cgroupRoot)
		stop() // the child gets the signals; RunIsolated forwards them
		code, err = e2eenv.RunIsolated(context.Background(), log)
		// Cleanup by name and pid, whatever the child did: a clean run
		// removed its cgroups itself, so anything found is a leak.
		if found, cerr := removeCgroupTree(mounts, cgroupRoot); len(found) > 0 || cerr != nil {
			fmt.Fprintf(log, "nodeenv: LEAK: %d cgroups left behind under /%s in %d hierarchies (removed now: %v)\n", len(found), cgroupRoot, len(mounts), cerr)
			code = max(code, 1)
		}
	}
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		code = max(code, 1)
	}
	notes, err := removeMountPoints(created)
	if len(notes) > 0 {
		fmt.Fprintf(log, "nodeenv: mount points %v were taken over by another user on the machine during the run (files or a mount); left in place\n", notes)
	}
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		code = max(code, 1)
	}
	if after := existingPaths(hardcodedPaths); !slices.Equal(after, pathsBefore) {
		fmt.Fprintf(log, "nodeenv: LEAK: paths on the machine before the run %v, after %v\n", pathsBefore, after)
		code = max(code, 1)
	}
	changed, err := restoreSysctls(saved)
	if len(changed) > 0 {
		fmt.Fprintf(log, "nodeenv: restored sysctls kubelet changed: %s\n", strings.Join(changed, ", "))
	}
	if err == nil {
		var now map[string]string
		if now, err = saveSysctls(kubeletSysctls); err == nil && !maps.Equal(now, saved) {
			err = fmt.Errorf("sysctls %v after restoring, want %v", now, saved)
		}
	}
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		code = max(code, 1)
	}
	return code
}

// start brings the node up on env's control plane, in the node network and
// mount namespace Program prepared: node address, CNI, containerd and the
// images, kubelet, kube-controller-manager, kube-scheduler; it returns when
// the Node is Ready and the not-ready taint is gone. On error it returns the
// partly started node (Close it).
func start(ctx context.Context, env *e2eenv.Env, mounts []cgroupMount, opts Options) (*Node, error) {
	cgroupRoot := os.Getenv(envCgroupRoot)
	if cgroupRoot == "" {
		return nil, errNoCgroupRoot
	}
	bins := env.Bins
	if err := bins.Check(build.Node...); err != nil {
		return nil, err
	}
	dir := filepath.Join(env.Dir, "node")
	n := &Node{
		Env: env, Bins: bins, Name: opts.NodeName, IP: opts.NodeIP, Dir: dir,
		ContainerdAddress: filepath.Join(dir, "containerd.sock"),
		ContainerdState:   filepath.Join(dir, "containerd", "state"),
		CNIBinDir:         filepath.Join(dir, "cni", "bin"),
		CNIConfDir:        filepath.Join(dir, "cni", "net.d"),
		IPAMDir:           filepath.Join(dir, "cni", "ipam"),
		Bridge:            opts.Bridge, PodSubnet: opts.PodSubnet,
		PodLogsDir: filepath.Join(dir, "pods"),
		log:        opts.Log, kubeletPort: opts.KubeletPort, registerTaints: opts.RegisterTaints,
		cgroupRoot: cgroupRoot, cgroups: mounts,
	}
	n.NetnsDir = "/var/run/netns"
	start := time.Now()
	if err := n.setupNetwork(ctx); err != nil {
		return n, err
	}
	if err := n.proxyKubernetesService(ctx); err != nil {
		return n, err
	}
	if err := n.startContainerd(ctx); err != nil {
		return n, err
	}
	if err := createCgroupRoot(n.cgroups, cgroupRoot); err != nil {
		return n, err
	}
	if err := n.startKubelet(ctx); err != nil {
		return n, err
	}
	if err := n.startControllers(ctx); err != nil {
		return n, err
	}
	if err := n.waitNodeReady(ctx); err != nil {
		return n, err
	}
	n.BringUp = time.Since(start)
	fmt.Fprintf(n.log, "nodeenv: node %s Ready in %s (containerd, kubelet, kube-controller-manager, kube-scheduler)\n", n.Name, n.BringUp.Round(time.Millisecond))
	return n, nil
}

// setupNetwork gives the node netns its node address and the CNI dirs:
// links to the reference plugins and the bridge conflist. kubelet wants a
// non-loopback node IP on an interface; the address sits on one end of a veth
// pair that stays inside the node netns (a dummy interface would do, but
// kernels without the dummy module exist, this machine's among them).
func (n *Node) setupNetwork(ctx context.Context) error {
	for _, args := range [][]string{
		{"link", "add", "node0", "type", "veth", "peer", "name", "node0p"},
		{"addr", "add", n.IP.String() + "/32", "dev", "node0"},
		{"link", "set", "node0p", "up"},
		{"link", "set", "node0", "up"},
	} {
		if out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("node address: ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
		}
	}
	for _, d := range []string{n.CNIBinDir, n.CNIConfDir, n.IPAMDir, n.PodLogsDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if err := os.Symlink(filepath.Join(n.Env.Bins.CNIRefDir, p), filepath.Join(n.CNIBinDir, p)); err != nil {
			return fmt.Errorf("CNI bin dir: %w", err)
		}
	}
	conf, err := nodeConflist(n.Bridge, n.PodSubnet.String(), n.IPAMDir)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(n.CNIConfDir, "10-ambientd-node.conflist"), conf, 0o644); err != nil {
		return err
	}
	return bindStdCNIDirs(n.CNIConfDir, n.CNIBinDir)
}

func (n *Node) startContainerd(ctx context.Context) error {
	dir := filepath.Join(n.Dir, "containerd")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	cfg := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfg, []byte(containerdConfig(dir, n.ContainerdAddress, n.Bins.Runc, StdCNIBinDir, StdCNIConfDir)), 0o644); err != nil {
		return err
	}
	// The shim is found on PATH next to containerd (Debian: /usr/bin).
	p, err := n.Env.StartProcess("containerd", n.Bins.Containerd, nil, "--config", cfg, "--log-level", "info")
	if err != nil {
		return err
	}
	n.Containerd = p
	if err := n.waitContainerdAPI(ctx); err != nil {
		return err
	}
	tars, err := buildImages(ctx, n.Env.Root, filepath.Join(n.Dir, "images"))
	if err != nil {
		return err
	}
	return importImages(ctx, n.Bins.Ctr, n.ContainerdAddress, tars)
}

func (n *Node) waitContainerdAPI(ctx context.Context) error {
	return waitFor(ctx, n.Containerd, "containerd API", 100*time.Millisecond, func(ctx context.Context) error {
		return ctrVersion(ctx, n.Bins.Ctr, n.ContainerdAddress)
	})
}

func (n *Node) startKubelet(ctx context.Context) error {
	dir := filepath.Join(n.Dir, "kubelet")
	root := filepath.Join(dir, "root")
	n.StaticPodDir = filepath.Join(dir, "manifests")
	for _, d := range []string{root, filepath.Join(dir, "volume-plugins"), n.StaticPodDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	resolv := filepath.Join(dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver 127.0.0.1\n"), 0o644); err != nil {
		return err
	}
	healthz, err := freePort()
	if err != nil {
		return err
	}
	n.kubeletHealthz = healthz
	cfg, err := kubeletConfig(kubeletPaths{
		RootDir: root, PodLogsDir: n.PodLogsDir, VolumePluginDir: filepath.Join(dir, "volume-plugins"),
		ResolvConf: resolv, RuntimeEndpoint: "unix://" + n.ContainerdAddress, StaticPodPath: n.StaticPodDir,
	}, n.cgroupRoot, n.kubeletPort, healthz, n.registerTaints)
	if err != nil {
		return err
	}
	cfgFile := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfgFile, cfg, 0o644); err != nil {
		return err
	}
	p, err := n.Env.StartProcess("kubelet", n.Bins.Kubelet, nil,
		kubeletArgs(cfgFile, n.Env.CP.AdminKubeconfig, root, n.Name, n.IP.String())...)
	if err != nil {
		return err
	}
	n.Kubelet = p
	return n.waitKubeletHealthy(ctx)
}

func (n *Node) waitKubeletHealthy(ctx context.Context) error {
	return waitFor(ctx, n.Kubelet, "kubelet /healthz", 100*time.Millisecond, func(ctx context.Context) error {
		return httpOK(ctx, "http://127.0.0.1:"+strconv.Itoa(n.kubeletHealthz)+"/healthz")
	})
}

func (n *Node) startControllers(ctx context.Context) error {
	kcmPort, err := freePort()
	if err != nil {
		return err
	}
	schedPort, err := freePort()
	if err != nil {
		return err
	}
	kc := n.Env.CP.AdminKubeconfig
	if n.ControllerManager, err = n.Env.StartProcess("kube-controller-manager", n.Bins.ControllerManager, nil,
		controllerManagerArgs(kc, n.Env.CP.CAFile, filepath.Join(n.Dir, "kube-controller-manager"), kcmPort)...); err != nil {
		return err
	}
	if n.Scheduler, err = n.Env.StartProcess("kube-scheduler", n.Bins.Scheduler, nil,
		schedulerArgs(kc, filepath.Join(n.Dir, "kube-scheduler"), schedPort)...); err != nil {
		return err
	}
	for _, c := range []struct {
		p    *e2eenv.Process
		port int
	}{{n.ControllerManager, kcmPort}, {n.Scheduler, schedPort}} {
		if err := waitFor(ctx, c.p, "/healthz", 200*time.Millisecond, func(ctx context.Context) error {
			return httpOK(ctx, "https://127.0.0.1:"+strconv.Itoa(c.port)+"/healthz")
		}); err != nil {
			return err
		}
	}
	return nil
}

// waitNodeReady waits until the Node is Ready and kube-controller-manager
// removed node.kubernetes.io/not-ready.
func (n *Node) waitNodeReady(ctx context.Context) error {
	return waitFor(ctx, n.Kubelet, "Node "+n.Name+" Ready and untainted", 200*time.Millisecond, func(ctx context.Context) error {
		node, err := n.Env.CP.Admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		return NodeReady(node)
	})
}

// NodeReady says why node is not Ready and schedulable yet (nil when it is).
func NodeReady(node *corev1.Node) error {
	ready := false
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status != corev1.ConditionTrue {
				return fmt.Errorf("condition Ready=%s: %s", c.Status, c.Message)
			}
			ready = true
		}
	}
	if !ready {
		return errors.New("no Ready condition yet")
	}
	for _, t := range node.Spec.Taints {
		if t.Key == corev1.TaintNodeNotReady || t.Key == corev1.TaintNodeUnreachable {
			return fmt.Errorf("taint %s still set", t.Key)
		}
	}
	return nil
}

// Close stops the node: kube-scheduler, kube-controller-manager, kubelet,
// containerd; then kills containerd's shims by pid and every process left in
// kubelet's cgroups (the pods' containers), and removes those cgroups. Pod
// network namespaces and rootfs mounts are under the work dir, which
// e2eenv.Env.Close unmounts and removes. Safe on a partly started node.
func (n *Node) Close() error {
	n.logRSS()
	var errs []error
	for _, p := range []*e2eenv.Process{n.Scheduler, n.ControllerManager, n.Kubelet, n.Containerd} {
		if p != nil {
			errs = append(errs, p.Stop(10*time.Second))
		}
	}
	killPids(shimPids(n.ContainerdAddress))
	if n.cgroupRoot != "" && n.cgroups != nil {
		if _, err := removeCgroupTree(n.cgroups, n.cgroupRoot); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ImportImage loads a docker-archive or OCI tarball (e.g. the agent's image
// from `make image`) into the node's containerd, for pods with
// imagePullPolicy: Never.
func (n *Node) ImportImage(ctx context.Context, tarball string) error {
	return importImages(ctx, n.Bins.Ctr, n.ContainerdAddress, []string{tarball})
}

// Kubectl runs kubectl with the admin kubeconfig and returns its combined
// output; a failure's error includes the output.
func (n *Node) Kubectl(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, n.Bins.Kubectl, append([]string{"--kubeconfig=" + n.Env.CP.AdminKubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// logRSS prints the resident memory of the node's processes and shims.
func (n *Node) logRSS() {
	var parts []string
	for _, p := range []*e2eenv.Process{n.Containerd, n.Kubelet, n.ControllerManager, n.Scheduler} {
		if p != nil && p.Running() {
			parts = append(parts, fmt.Sprintf("%s %d", p.Name, rssMiB(p.Pid())))
		}
	}
	shims := shimPids(n.ContainerdAddress)
	total := 0
	for _, pid := range shims {
		total += rssMiB(pid)
	}
	fmt.Fprintf(n.log, "nodeenv: RSS MiB at close: %s, %d shims %d\n", strings.Join(parts, ", "), len(shims), total)
}

// rssMiB is a process's VmRSS in MiB (0 when unknown).
func rssMiB(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.Atoi(f[1])
			return kb / 1024
		}
	}
	return 0
}

// waitFor is p.WaitUntil for a check that returns nil when it holds, each
// attempt bounded to 10 seconds.
func waitFor(ctx context.Context, p *e2eenv.Process, what string, interval time.Duration, check func(context.Context) error) error {
	return p.WaitUntil(ctx, what, interval, func(ctx context.Context) (bool, error) {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		err := check(cctx)
		return err == nil, err
	})
}

func httpOK(ctx context.Context, url string) error {
	// Self-signed serving certificates on loopback, inside the node netns.
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %d %s", url, resp.StatusCode, strings.TrimSpace(string(b)))
	}
	return nil
}

func freePort() (int, error) {
	a, err := e2eenv.FreeAddr()
	if err != nil {
		return 0, err
	}
	ap, err := netip.ParseAddrPort(a)
	if err != nil {
		return 0, err
	}
	return int(ap.Port()), nil
}
