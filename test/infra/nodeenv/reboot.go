package nodeenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// runtimeDirs are the node's paths that live on tmpfs on a real node (/run)
// and so are empty after a reboot: containerd's shim sockets, the pods'
// network namespaces, the agent's run dir (its state file, sticky backend
// choice, sockets) and ztunnel's socket dir. Disk paths (/var/lib/cni,
// /var/lib/kubelet, /var/log, containerd's root with its image store and
// metadata, host-local's leases, the CNI config and binaries) survive.
var runtimeDirs = []string{"/run/containerd", "/run/netns", "/run/ambientd", "/run/ztunnel"}

// keepNodeNetns keeps the environment's own node netns (ambientd-e2e-...,
// which /run/netns may show next to the pods' cni-<id>): it is the machine
// the node runs on, not the node's.
func keepNodeNetns(name string) bool { return strings.HasPrefix(name, "ambientd-e2e-") }

// PowerOff stops the node the way a power cut or a hard reset does, and
// leaves it as a reboot would find it: kubelet and containerd are SIGKILLed,
// then every containerd shim and every process in kubelet's cgroups (all
// containers, the agent's included); the pods' network namespaces (and their
// veths) disappear, /run is emptied (runtimeDirs, containerd's and runc's
// state dirs), the node's firewall (nftables, iptables-legacy, ipsets) is
// flushed and the pod bridge deleted. The control plane, kube-controller-
// manager and kube-scheduler keep running: they are other machines. The Node
// object and every pod object stay in the API, with the status they had.
func (n *Node) PowerOff(ctx context.Context) error {
	var errs []error
	for _, p := range []*e2eenv.Process{n.Kubelet, n.Containerd} {
		if p != nil {
			errs = append(errs, p.Kill())
		}
	}
	killPids(shimPids(n.ContainerdAddress))
	// Kill the containers and drop their cgroups; kubelet's cgroup root is
	// made again by PowerOn (kubelet refuses a missing one).
	if _, err := removeCgroupTree(n.cgroups, n.cgroupRoot); err != nil {
		errs = append(errs, err)
	}
	for _, d := range append(runtimeDirs, filepath.Join(n.Dir, "containerd", "state"), filepath.Join(n.Dir, "containerd", "runc")) {
		errs = append(errs, emptyDir(d, keepNodeNetns))
	}
	errs = append(errs, flushFirewall(ctx))
	if out, err := exec.CommandContext(ctx, "ip", "link", "del", n.Bridge).CombinedOutput(); err != nil && !strings.Contains(string(out), "Cannot find device") {
		errs = append(errs, fmt.Errorf("ip link del %s: %w: %s", n.Bridge, err, strings.TrimSpace(string(out))))
	}
	return errors.Join(errs...)
}

// PowerOn boots the node again after PowerOff: kubelet's cgroup root, the
// kubernetes Service's DNAT (proxyKubernetesService), then containerd and
// kubelet with the configuration they had (containerd keeps its
// images and metadata), and returns once both answer. Kubelet then finds the
// pods bound to the node in the API and makes new sandboxes for them, as
// after a reboot; PowerOn does not wait for that.
func (n *Node) PowerOn(ctx context.Context) error {
	if err := createCgroupRoot(n.cgroups, n.cgroupRoot); err != nil {
		return err
	}
	if err := n.proxyKubernetesService(ctx); err != nil {
		return err
	}
	if err := n.Containerd.Start(); err != nil {
		return fmt.Errorf("start containerd: %w", err)
	}
	if err := n.waitContainerdAPI(ctx); err != nil {
		return err
	}
	if err := n.Kubelet.Start(); err != nil {
		return fmt.Errorf("start kubelet: %w", err)
	}
	return n.waitKubeletHealthy(ctx)
}

// PrimaryCNIBoot does what a primary CNI's installer does when a node boots
// (Calico's install-cni, flannel's init container, Cilium's agent): it
// writes its conflist from its template again, in place (`cp -f`), whatever
// the file held — a chained plugin's entry in that file is gone. boot is
// recorded in the file (primaryConflist) so a test can see whether a copy
// of the primary's config follows this write. It returns what it wrote.
// Called between PowerOff and PowerOn it runs before anything kubelet
// starts, the agent included.
//
// A double of no one release: it follows what flannel's install-cni init
// container does (`cp -f /etc/kube-flannel/cni-conf.json
// /etc/cni/net.d/10-flannel.conflist`, kube-flannel.yml), the in-place
// rewrite that Calico's install-cni and Cilium's agent make too. Does not
// emulate: the primary's plugin itself (the node's chain stays the
// reference bridge), its daemon, or a rewrite after boot.
func (n *Node) PrimaryCNIBoot(boot string) ([]byte, error) {
	conf, err := primaryConflist(n.Bridge, n.PodSubnet.String(), n.IPAMDir, boot)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(n.CNIConfDir, Conflist), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	if _, err := f.Write(conf); err != nil {
		f.Close()
		return nil, err
	}
	return conf, f.Close()
}

// emptyDir removes everything in dir whose name keep does not accept (keep
// may be nil), unmounting what is mounted there first (network namespace
// files, container root filesystems), and keeps dir itself.
func emptyDir(dir string, keep func(name string) bool) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if keep != nil && keep(e.Name()) {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if err := e2eenv.UnmountUnder(p); err != nil {
			errs = append(errs, err)
			continue
		}
		// The entry itself may be a mount point (a netns file: nsfs).
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && err != unix.EINVAL {
			errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
			continue
		}
		errs = append(errs, os.RemoveAll(p))
	}
	return errors.Join(errs...)
}

// flushFirewall empties the node netns's packet filter, as a reboot does:
// every nftables table (iptables-nft's included), every iptables-legacy
// chain and rule of both families, every ipset.
func flushFirewall(ctx context.Context) error {
	cmds := [][]string{{"nft", "flush", "ruleset"}}
	for _, bin := range []string{"iptables-legacy", "ip6tables-legacy"} {
		for _, table := range []string{"filter", "nat", "mangle", "raw"} {
			cmds = append(cmds, []string{bin, "-w", "5", "-t", table, "-F"}, []string{bin, "-w", "5", "-t", table, "-X"})
		}
	}
	cmds = append(cmds, []string{"ipset", "destroy"})
	var errs []error
	for _, c := range cmds {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		out, err := exec.CommandContext(cctx, c[0], c[1:]...).CombinedOutput()
		cancel()
		// A legacy table that was never loaded cannot be listed: nothing to flush.
		if err != nil && !strings.Contains(string(out), "does not exist") && !strings.Contains(string(out), "Table does not exist") {
			errs = append(errs, fmt.Errorf("%s: %w: %s", strings.Join(c, " "), err, strings.TrimSpace(string(out))))
		}
	}
	return errors.Join(errs...)
}
