package nodeenv

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

// The node's own PID namespace (Options.PIDNamespace).
//
// On a real node pid 1 is the host's init, in the host network namespace, and
// node agents rely on it: Istio's node agent stats /host/proc/1/ns/net at
// start to know the host's network namespace (and exits when it cannot). Here
// the node is a network namespace on a machine whose pid 1 lives elsewhere —
// and, on this machine, whose namespaces cannot even be read. With the
// option, the node gets a PID namespace of its own, as a machine has: the
// program re-runs itself as that namespace's init (pid 1, in the node's
// network namespace), which mounts a fresh /proc showing only the node's
// processes and runs the node and the tests as its child. Kubelet,
// containerd, the containers and every hostPID pod then see the node's
// processes, with the node's pid 1, through /proc and hostPath /proc.
const (
	// envPIDNSInit marks the re-run that is the namespace's init.
	envPIDNSInit = "AMBIENTD_NODE_PIDNS_INIT"
	// envPIDNSMounts carries the cgroup hierarchies, read before the PID
	// namespace hid the machine's pid 1, to the run inside it.
	envPIDNSMounts = "AMBIENTD_NODE_PIDNS_MOUNTS"
)

// enterPIDNamespace runs, in the node netns, once the mount namespace is
// prepared: it starts this program again as pid 1 of a new PID namespace
// (with its own copy of the mount namespace) and returns its exit code.
func enterPIDNamespace(mounts []cgroupMount, log io.Writer) int {
	b, err := json.Marshal(mounts)
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		return 1
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		return 1
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), envPIDNSInit+"=1", envPIDNSMounts+"="+string(b))
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	return runForwarding(cmd, log)
}

// runForwarding starts cmd, forwards SIGINT and SIGTERM to it and returns
// its exit code.
func runForwarding(cmd *exec.Cmd, log io.Writer) int {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(log, "nodeenv: start %s: %v\n", cmd.Path, err)
		return 1
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case s := <-sigs:
				_ = cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err := cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return max(ee.ExitCode(), 1)
	}
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		return 1
	}
	return 0
}

// pidNamespaceInit is the program as the node's pid 1: it mounts the
// namespace's /proc (on its own mount of /proc, made private first, so the
// parent's /proc is untouched), starts the program once more as its only
// child, forwards signals to it and reaps every process the namespace
// orphans, until that child exits; its exit code is the child's. When it
// returns, the kernel kills whatever is left in the namespace.
func pidNamespaceInit(log io.Writer) int {
	if err := unix.Mount("", "/proc", "", unix.MS_PRIVATE|unix.MS_REC, ""); err != nil {
		fmt.Fprintf(log, "nodeenv: make /proc private in the node's PID namespace: %v\n", err)
		return 1
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		fmt.Fprintf(log, "nodeenv: mount the node's /proc: %v\n", err)
		return 1
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(log, "nodeenv: %v\n", err)
		return 1
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = os.Environ()
	for i, kv := range cmd.Env {
		if len(kv) > len(envPIDNSInit) && kv[:len(envPIDNSInit)+1] == envPIDNSInit+"=" {
			cmd.Env = append(cmd.Env[:i:i], cmd.Env[i+1:]...)
			break
		}
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(log, "nodeenv: start the node's run: %v\n", err)
		return 1
	}
	main := cmd.Process.Pid
	go func() {
		for s := range sigs {
			_ = syscall.Kill(main, s.(syscall.Signal))
		}
	}()
	// pid 1 reaps every orphan of the namespace (containerd's shims
	// re-parent here); cmd.Wait is never called: wait4(-1) takes the
	// child's status too.
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			fmt.Fprintf(log, "nodeenv: node init: wait: %v\n", err)
			return 1
		}
		if pid != main {
			continue
		}
		if ws.Signaled() {
			return 1
		}
		return ws.ExitStatus()
	}
}

// pidNamespaceMounts returns the cgroup hierarchies the run inside the PID
// namespace got from the run that created it.
func pidNamespaceMounts() ([]cgroupMount, bool, error) {
	s, ok := os.LookupEnv(envPIDNSMounts)
	if !ok {
		return nil, false, nil
	}
	var mounts []cgroupMount
	if err := json.Unmarshal([]byte(s), &mounts); err != nil {
		return nil, true, fmt.Errorf("%s: %w", envPIDNSMounts, err)
	}
	return mounts, true, nil
}
