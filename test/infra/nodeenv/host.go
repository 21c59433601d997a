package nodeenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// kubeletSysctls are the machine-wide sysctls kubelet sets when it starts
// (pkg/kubelet/cm setupKernelTunables). They are not per network namespace,
// so the run changes the machine's values; the outer process saves and
// restores them. net.ipv4.ip_forward, which the bridge plugin sets, is per
// network namespace and changes only inside the node netns.
var kubeletSysctls = []string{
	"vm.overcommit_memory",
	"vm.panic_on_oom",
	"kernel.panic",
	"kernel.panic_on_oops",
	"kernel.keys.root_maxkeys",
	"kernel.keys.root_maxbytes",
}

func sysctlPath(name string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(name, ".", "/"))
}

// saveSysctls reads the current values of names.
func saveSysctls(names []string) (map[string]string, error) {
	saved := map[string]string{}
	for _, n := range names {
		b, err := os.ReadFile(sysctlPath(n))
		if err != nil {
			return nil, fmt.Errorf("save sysctl %s: %w", n, err)
		}
		saved[n] = strings.TrimSpace(string(b))
	}
	return saved, nil
}

// restoreSysctls writes back every saved value that differs now and returns
// "name: now -> saved" for each one it changed.
func restoreSysctls(saved map[string]string) ([]string, error) {
	var changed []string
	var errs []error
	for n, want := range saved {
		b, err := os.ReadFile(sysctlPath(n))
		if err != nil {
			errs = append(errs, fmt.Errorf("restore sysctl %s: %w", n, err))
			continue
		}
		now := strings.TrimSpace(string(b))
		if now == want {
			continue
		}
		if err := os.WriteFile(sysctlPath(n), []byte(want), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore sysctl %s to %s: %w", n, want, err))
			continue
		}
		changed = append(changed, fmt.Sprintf("%s: %s -> %s", n, now, want))
	}
	return changed, errors.Join(errs...)
}

// lockFile serializes real-node runs on one machine.
const lockFile = "/run/lock/ambientd-e2e-node.lock"

// lockMachine waits (until ctx ends) for the machine-wide real-node lock and
// returns its release. The lock is a flock, so it goes away with a process
// that dies holding it.
func lockMachine(ctx context.Context, log io.Writer) (func(), error) {
	if err := os.MkdirAll(filepath.Dir(lockFile), 0o755); err != nil {
		return nil, fmt.Errorf("lock %s: %w", lockFile, err)
	}
	f, err := os.OpenFile(lockFile, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", lockFile, err)
	}
	told := false
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", lockFile, err)
		}
		if !told {
			fmt.Fprintf(log, "nodeenv: another real node runs on this machine; waiting for %s\n", lockFile)
			told = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for %s: %w", lockFile, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// tmpfsPaths get a tmpfs (a shared mount, so mounts below propagate to
// containers that mount them with HostToContainer) in the node's mount
// namespace. They are the paths containerd 1.6, libcni and kubelet hard-code,
// and the standard node paths ambientd's DaemonSet mounts (deploy/):
//   - /run/containerd: shim sockets (/run/containerd/s);
//   - /var/lib/cni: libcni's result cache;
//   - /var/lib/kubelet: the device plugin socket dir is a constant, whatever
//     --root-dir says;
//   - /var/log: kubelet's /var/log/containers links (pod logs go to the work
//     dir);
//   - /run/netns: the pods' network namespaces (containerd's default place);
//   - /run/ambientd, /run/ztunnel: the agent's and ztunnel's sockets (the
//     DaemonSet's hostPaths /var/run/ambientd, /var/run/ztunnel);
//   - /run/istio-cni: Istio's node agent's run dir (its DaemonSet's hostPath
//     /var/run/istio-cni: plugin socket, the plugin's kubeconfig), for the
//     switch scenarios that run Istio's agent on the node (test/e2eswitch).
var tmpfsPaths = []string{"/run/containerd", "/var/lib/cni", "/var/lib/kubelet", "/var/log", "/run/netns", "/run/ambientd", "/run/ztunnel", "/run/istio-cni"}

// Standard CNI dirs: in the node's mount namespace the node's own CNI dirs
// (under the work dir) are bind-mounted here, so containerd and the
// DaemonSet's hostPaths use the usual paths.
const (
	StdCNIConfDir = "/etc/cni/net.d"
	StdCNIBinDir  = "/opt/cni/bin"
)

// mountPoints are every path the node mounts over.
func mountPoints() []string {
	return append(slices.Clone(tmpfsPaths), StdCNIConfDir, StdCNIBinDir)
}

// hardcodedPaths are default paths of containerd, kubelet and the control
// plane components on the machine that no mount of the node covers; with the
// configuration of this environment none of them may appear during a run.
// (The mount points in mountPoints cannot receive anything from the node: in
// its mount namespace they are covered.)
var hardcodedPaths = []string{
	"/var/lib/containerd", "/etc/containerd", "/usr/libexec/kubernetes", "/etc/kubernetes", "/var/run/kubernetes",
}

// existingPaths returns those of paths that exist.
func existingPaths(paths []string) []string {
	var out []string
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// makeMountPoints creates the missing mountPoints on the machine (empty
// directories, mount points only) and returns the ones it created.
func makeMountPoints() ([]string, error) {
	var created []string
	for _, p := range mountPoints() {
		if _, err := os.Stat(p); err == nil {
			continue
		}
		// Create parents one by one so each directory we made is removed again.
		var chain []string
		for d := p; ; d = filepath.Dir(d) {
			if _, err := os.Stat(d); err == nil {
				break
			}
			chain = append([]string{d}, chain...)
		}
		for _, d := range chain {
			if err := os.Mkdir(d, 0o755); err != nil {
				return created, fmt.Errorf("create mount point %s: %w", d, err)
			}
			created = append(created, d)
		}
	}
	return created, nil
}

// removeMountPoints removes the directories makeMountPoints created, deepest
// first. One that is not empty any more was filled on the machine by someone
// else during the run (the node only ever wrote to it through its own mount,
// in its namespace): it is left in place and named in the returned notes.
func removeMountPoints(created []string) (notes []string, err error) {
	var errs []error
	for i := len(created) - 1; i >= 0; i-- {
		err := os.Remove(created[i])
		switch {
		case err == nil, errors.Is(err, os.ErrNotExist):
		case errors.Is(err, unix.ENOTEMPTY), errors.Is(err, unix.EEXIST):
			notes = append(notes, created[i])
		case errors.Is(err, unix.EBUSY):
			// A mount point now: /run/netns, which `ip netns add` (the
			// environment's own node netns) turns into a bind mount of
			// itself the first time on a machine, and keeps so for every
			// later user. It is iproute2's, not ours to remove.
			notes = append(notes, created[i]+" (now a mount point, e.g. of ip netns)")
		default:
			errs = append(errs, fmt.Errorf("remove mount point %s: %w", created[i], err))
		}
	}
	return notes, errors.Join(errs...)
}

// cgroupMount is one cgroup hierarchy mount of the machine.
type cgroupMount struct {
	Dir     string // mount point, e.g. /sys/fs/cgroup/cpu
	FSType  string // cgroup or cgroup2
	Options string // super options without rw/ro, e.g. "cpu" or "none,name=systemd"
}

// hostCgroupMounts lists the cgroup hierarchies mounted under /sys/fs/cgroup
// as the machine's init process (pid 1) sees them; parsed from a mountinfo.
func hostCgroupMounts(mountinfo string) ([]cgroupMount, error) {
	f, err := os.Open(mountinfo)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parseCgroupMounts(bufio.NewScanner(f))
}

func parseCgroupMounts(sc *bufio.Scanner) ([]cgroupMount, error) {
	var out []cgroupMount
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		for i, fld := range fields {
			if fld != "-" || i+3 >= len(fields) || i < 5 {
				continue
			}
			fstype, super := fields[i+1], fields[i+3]
			if fstype != "cgroup" && fstype != "cgroup2" {
				break
			}
			var opts []string
			for _, o := range strings.Split(super, ",") {
				if o != "rw" && o != "ro" && o != "" {
					opts = append(opts, o)
				}
			}
			if fstype == "cgroup" && len(opts) > 0 && strings.HasPrefix(opts[0], "name=") {
				opts = append([]string{"none"}, opts...)
			}
			out = append(out, cgroupMount{Dir: fields[4], FSType: fstype, Options: strings.Join(opts, ",")})
			break
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no cgroup hierarchy mounted on this machine")
	}
	return out, nil
}

// removeCgroupTree kills every process in, and removes, the cgroup dir
// (relative to each hierarchy's mount) in every hierarchy; it returns the
// cgroup directories it found (nil when there was nothing).
func removeCgroupTree(mounts []cgroupMount, rel string) ([]string, error) {
	var found []string
	var errs []error
	for _, m := range mounts {
		top := filepath.Join(m.Dir, rel)
		if _, err := os.Stat(top); err != nil {
			continue
		}
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		found = append(found, dirs...)
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := e2eenv.RemoveCgroup(dirs[i]); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return found, errors.Join(errs...)
}
