package nodeenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// prepareMountNamespace runs in the node netns's private mount namespace
// (made by `ip netns exec`, slave of the machine's, so nothing propagates
// back): it mounts the machine's cgroup hierarchies again under
// /sys/fs/cgroup, where kubelet, containerd and runc look for them (`ip netns
// exec` remounted /sys and so hid them), and a shared tmpfs over each of
// tmpfsPaths. The machine's mounts stay unaffected: `ip netns exec` made this
// namespace's copies slaves (or private), never peers of the machine's.
func prepareMountNamespace(mounts []cgroupMount) error {
	// As on a systemd node, every mount is shared (within this namespace and
	// the containers' copies): containerd refuses HostToContainer
	// propagation from a path whose mount is neither shared nor slave, and
	// `ip netns exec` leaves the tree private when the machine's / is.
	if err := unix.Mount("", "/", "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make / rshared in the node's mount namespace: %w", err)
	}
	if err := unix.Mount("cgroup-root", "/sys/fs/cgroup", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=755"); err != nil {
		return fmt.Errorf("mount tmpfs on /sys/fs/cgroup: %w", err)
	}
	for _, m := range mounts {
		if !strings.HasPrefix(m.Dir, "/sys/fs/cgroup/") && m.Dir != "/sys/fs/cgroup" {
			continue
		}
		if err := os.MkdirAll(m.Dir, 0o755); err != nil {
			return fmt.Errorf("cgroup mount point: %w", err)
		}
		if err := unix.Mount("cgroup", m.Dir, m.FSType, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, m.Options); err != nil {
			return fmt.Errorf("mount %s (%s) on %s: %w", m.FSType, m.Options, m.Dir, err)
		}
	}
	for _, p := range tmpfsPaths {
		if err := unix.Mount("ambientd-node", p, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755"); err != nil {
			return fmt.Errorf("mount tmpfs on %s: %w", p, err)
		}
		if err := unix.Mount("", p, "", unix.MS_SHARED, ""); err != nil {
			return fmt.Errorf("make %s shared: %w", p, err)
		}
	}
	return nil
}

// bindStdCNIDirs bind-mounts the node's CNI dirs at the standard paths, as
// shared mounts.
func bindStdCNIDirs(confDir, binDir string) error {
	for _, b := range []struct{ src, dst string }{{confDir, StdCNIConfDir}, {binDir, StdCNIBinDir}} {
		if err := unix.Mount(b.src, b.dst, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind-mount %s on %s: %w", b.src, b.dst, err)
		}
		if err := unix.Mount("", b.dst, "", unix.MS_SHARED, ""); err != nil {
			return fmt.Errorf("make %s shared: %w", b.dst, err)
		}
	}
	return nil
}

// createCgroupRoot makes kubelet's cgroup root (rel, relative to each
// hierarchy) in every hierarchy: kubelet refuses a cgroupRoot that does not
// exist. A v1 cpuset cgroup starts with no CPUs and no memory nodes, so it
// gets its parent's.
func createCgroupRoot(mounts []cgroupMount, rel string) error {
	for _, m := range mounts {
		dir := filepath.Join(m.Dir, rel)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		if m.FSType != "cgroup" || !hasOption(m.Options, "cpuset") {
			continue
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			b, err := os.ReadFile(filepath.Join(m.Dir, f))
			if err != nil {
				return fmt.Errorf("cgroup %s: %w", dir, err)
			}
			if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
				return fmt.Errorf("cgroup %s: set %s: %w", dir, f, err)
			}
		}
	}
	return nil
}

func hasOption(opts, want string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == want {
			return true
		}
	}
	return false
}

var errNoCgroupRoot = errors.New("no cgroup root name: the node environment must be started through Program or Main")
