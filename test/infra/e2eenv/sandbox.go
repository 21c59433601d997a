package e2eenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Sandbox processes: every pod CreatePod makes gets a real "pause" process
// (`sleep infinity`, entered into the pod's network namespace by nsenter) in a
// cgroup whose path names the pod uid the way kubelet's systemd cgroup driver
// does (kubepods-besteffort-pod<uid with _ for ->.slice). So the agent's /proc
// scan (--host-proc, default /proc) finds running pods exactly as on a node.
//
// The cgroups live in the cgroup2 (unified) hierarchy under one directory per
// environment, named like the work dir (WorkDirPrefix + run id + suffix), so
// hack/leftovers.sh can find what a run left. The test program runs under
// `ip netns exec`, which remounts /sys (and so hides /sys/fs/cgroup); when no
// cgroup2 mount is visible, the hierarchy is mounted under the work dir, in the
// run's private mount namespace. If cgroups cannot be created at all, Start
// fails: the /proc scan would not be real otherwise.

// cgroups is the environment's directory of pod cgroups.
type cgroups struct {
	dir       string // <cgroup2 mount>/<work dir base name>
	mountedAt string // our own cgroup2 mount under the work dir, or ""
}

func setupCgroups(workDir string) (*cgroups, error) {
	mnt, err := cgroup2Mount()
	if err != nil {
		return nil, err
	}
	cg := &cgroups{}
	if mnt == "" {
		mnt = filepath.Join(workDir, "cgroup2")
		if err := os.MkdirAll(mnt, 0o755); err != nil {
			return nil, fmt.Errorf("pod cgroups: %w", err)
		}
		if err := unix.Mount("none", mnt, "cgroup2", 0, ""); err != nil {
			return nil, fmt.Errorf("pod cgroups: no cgroup2 hierarchy mounted and mounting one at %s failed: %w", mnt, err)
		}
		cg.mountedAt = mnt
	}
	cg.dir = filepath.Join(mnt, filepath.Base(workDir))
	if err := os.Mkdir(cg.dir, 0o755); err != nil {
		cg.close()
		return nil, fmt.Errorf("pod cgroups: create %s: %w", cg.dir, err)
	}
	return cg, nil
}

// cgroup2Mount returns the mount point of a cgroup2 hierarchy visible to this
// process, or "" when there is none.
func cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		for i, fld := range fields {
			if fld == "-" && i+1 < len(fields) && i >= 4 {
				if fields[i+1] == "cgroup2" {
					return unescapeMount(fields[4]), nil
				}
				break
			}
		}
	}
	return "", sc.Err()
}

// podDir is the pod's cgroup, named as kubelet's systemd driver names it.
func (c *cgroups) podDir(uid string) string {
	return filepath.Join(c.dir, "kubepods-besteffort-pod"+strings.ReplaceAll(uid, "-", "_")+".slice")
}

// close removes every cgroup left below the environment's directory (their
// processes are killed first), the directory itself, and our own mount.
func (c *cgroups) close() error {
	var errs []error
	if c.dir != "" {
		entries, _ := os.ReadDir(c.dir)
		for _, en := range entries {
			if !en.IsDir() {
				continue
			}
			pod := filepath.Join(c.dir, en.Name())
			scopes, _ := os.ReadDir(pod)
			for _, sc := range scopes {
				if sc.IsDir() {
					errs = append(errs, removeCgroup(filepath.Join(pod, sc.Name())))
				}
			}
			errs = append(errs, removeCgroup(pod))
		}
		errs = append(errs, removeCgroup(c.dir))
	}
	if c.mountedAt != "" {
		if err := unix.Unmount(c.mountedAt, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", c.mountedAt, err))
		}
		c.mountedAt = ""
	}
	return errors.Join(errs...)
}

// RemoveCgroup SIGKILLs the processes of one cgroup directory (which must
// have no child cgroups left) and removes it; see removeCgroup.
func RemoveCgroup(dir string) error { return removeCgroup(dir) }

// removeCgroup SIGKILLs whatever is still in the cgroup dir and removes it,
// waiting (bounded) for the kernel to see it empty. A missing dir is fine.
func removeCgroup(dir string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil {
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startSandbox starts the pod's pause process inside its network namespace
// and its cgroup, and returns once the process is in both.
func (e *Env) startSandbox(ctx context.Context, p *Pod) error {
	if e.cgroups == nil {
		return errors.New("e2eenv: no pod cgroups (environment not started)")
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		return fmt.Errorf("pod sandbox needs util-linux's nsenter: %w", err)
	}
	var want syscall.Stat_t
	if err := syscall.Stat(p.NetnsPath, &want); err != nil {
		return fmt.Errorf("pod %s/%s sandbox: %w", p.Namespace, p.Name, err)
	}
	// One scope per sandbox below the pod's cgroup, as containerd makes
	// them: a recreated sandbox may run beside the old one.
	dir := filepath.Join(e.cgroups.podDir(p.RuntimeUID), "cri-containerd-"+p.ContainerID+".scope")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("pod %s/%s sandbox: create cgroup: %w", p.Namespace, p.Name, err)
	}
	p.cgroupDir = dir
	proc := newProcess(e.sp, "sandbox-"+p.Namespace+"-"+p.Name, nsenter, e.logPath("sandboxes"),
		"--net="+p.NetnsPath, "--", "sleep", "infinity")
	if err := proc.Start(); err != nil {
		return fmt.Errorf("pod %s/%s sandbox: %w", p.Namespace, p.Name, err)
	}
	p.sandbox = proc
	pid := proc.Pid()
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		return fmt.Errorf("pod %s/%s sandbox: move pid %d into cgroup %s: %w", p.Namespace, p.Name, pid, dir, err)
	}
	// nsenter switches namespaces, then execs sleep: wait until the process
	// is in the pod's netns (and still running).
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		var st syscall.Stat_t
		if err := syscall.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st); err == nil && st.Dev == want.Dev && st.Ino == want.Ino {
			if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); strings.TrimSpace(string(comm)) == "sleep" {
				return nil
			}
		}
		if !proc.Running() {
			return fmt.Errorf("pod %s/%s sandbox process exited: %v (log %s)", p.Namespace, p.Name, proc.ExitError(), proc.LogPath)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pod %s/%s sandbox pid %d never entered netns %s: %w", p.Namespace, p.Name, pid, p.NetnsPath, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// stopSandbox kills the pod's pause process and removes its cgroup.
// Stopping twice is fine.
func (p *Pod) stopSandbox() error {
	var errs []error
	if p.sandbox != nil {
		errs = append(errs, p.sandbox.Kill())
		p.sandbox = nil
	}
	if p.cgroupDir != "" {
		errs = append(errs, removeCgroup(p.cgroupDir))
		// The pod's cgroup goes with its last sandbox (another one of
		// the pod may still run in it).
		if err := os.Remove(filepath.Dir(p.cgroupDir)); err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, syscall.EBUSY) && !errors.Is(err, syscall.ENOTEMPTY) {
			errs = append(errs, fmt.Errorf("remove pod cgroup: %w", err))
		}
		p.cgroupDir = ""
	}
	return errors.Join(errs...)
}

// SandboxPid is the pid of the pod's pause process (0 when it has none).
func (p *Pod) SandboxPid() int {
	if p.sandbox == nil || !p.sandbox.Running() {
		return 0
	}
	return p.sandbox.Pid()
}

// StopSandbox kills the pod's pause process and removes its cgroup, as a
// runtime that keeps no process in the sandbox netns would look: the netns
// itself stays (bind-mounted at NetnsPath), but a /proc scan cannot find it.
func (e *Env) StopSandbox(p *Pod) error { return p.stopSandbox() }

// RestartSandbox starts the pod's pause process again (after StopSandbox).
func (e *Env) RestartSandbox(ctx context.Context, p *Pod) error {
	if p.sandbox != nil {
		return fmt.Errorf("pod %s/%s: sandbox still running", p.Namespace, p.Name)
	}
	return e.startSandbox(ctx, p)
}
