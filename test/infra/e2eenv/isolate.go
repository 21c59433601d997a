package e2eenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// NetnsPrefix starts the name of every node network namespace the
// environment creates: NetnsPrefix + "<pid of the creating process>-<random>".
// A namespace with this prefix whose creator is gone is a leftover of a
// crashed run; RunIsolated removes those first, and hack/e2e.sh fails the run
// when one exists after the suite.
const NetnsPrefix = "ambientd-e2e-"

// EnvNodeNetns is set, in the re-executed program, to the name of the node
// network namespace it runs in.
const EnvNodeNetns = "AMBIENTD_E2E_NETNS"

// EnvRunID tags every process of one run (the variable is inherited), so
// hack/e2e.sh can find leftovers of exactly this run in /proc/*/environ.
const EnvRunID = "AMBIENTD_E2E_RUN"

// InNodeNetns reports whether this process already runs inside a node
// network namespace made by RunIsolated.
func InNodeNetns() bool { return os.Getenv(EnvNodeNetns) != "" }

// RunIsolated runs this program again, with the same arguments and
// environment, inside a fresh node network namespace (only lo, up), waits for
// it, then kills whatever still runs in that namespace and deletes it. It
// returns the child's exit code. SIGINT, SIGTERM and SIGQUIT are forwarded to
// the child (go test sends SIGQUIT on timeout). Leftover processes in the
// namespace after the child exited are reported on log and turn a 0 exit code
// into 1: a clean run stops everything it started.
func RunIsolated(ctx context.Context, log io.Writer) (int, error) {
	if os.Geteuid() != 0 {
		return 1, errors.New("e2e environment needs root (network namespaces, bridge, iptables)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return 1, fmt.Errorf("e2e environment needs iproute2's ip (run hack/deps.sh): %w", err)
	}
	CleanLeftoverNetns(ctx, log)

	name := NetnsPrefix + strconv.Itoa(os.Getpid()) + "-" + randHex(3)
	if out, err := exec.CommandContext(ctx, "ip", "netns", "add", name).CombinedOutput(); err != nil {
		return 1, fmt.Errorf("ip netns add %s: %w: %s", name, err, strings.TrimSpace(string(out)))
	}
	defer func() {
		if err := deleteNetns(context.Background(), name); err != nil {
			fmt.Fprintf(log, "e2eenv: %v\n", err)
		}
	}()
	if out, err := exec.CommandContext(ctx, "ip", "-n", name, "link", "set", "lo", "up").CombinedOutput(); err != nil {
		return 1, fmt.Errorf("ip -n %s link set lo up: %w: %s", name, err, strings.TrimSpace(string(out)))
	}

	exe, err := os.Executable()
	if err != nil {
		return 1, fmt.Errorf("find own executable: %w", err)
	}
	runID := os.Getenv(EnvRunID)
	if runID == "" {
		runID = name
	}
	cmd := exec.Command("ip", append([]string{"netns", "exec", name, exe}, os.Args[1:]...)...)
	cmd.Env = append(os.Environ(), EnvNodeNetns+"="+name, EnvRunID+"="+runID)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// Started from a thread that stays locked until Wait returns, so the
	// child's Pdeathsig fires only if this process dies (see spawner).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	defer signal.Stop(sigs)

	type result struct {
		code int
		err  error
	}
	started := make(chan error, 1)
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		err := cmd.Wait()
		var ee *exec.ExitError
		switch {
		case err == nil:
			done <- result{code: 0}
		case errors.As(err, &ee):
			code := ee.ExitCode()
			if code < 0 { // killed by a signal
				code = 128 + int(ee.Sys().(syscall.WaitStatus).Signal())
			}
			done <- result{code: code}
		default:
			done <- result{code: 1, err: err}
		}
	}()
	if err := <-started; err != nil {
		return 1, fmt.Errorf("start %s in netns %s: %w", exe, name, err)
	}
	var res result
wait:
	for {
		select {
		case s := <-sigs:
			_ = cmd.Process.Signal(s)
		case res = <-done:
			break wait
		}
	}
	leftovers, err := killNetnsPids(context.Background(), name)
	if err != nil {
		fmt.Fprintf(log, "e2eenv: %v\n", err)
	}
	if len(leftovers) > 0 {
		fmt.Fprintf(log, "e2eenv: LEAK: processes still running in %s after the run (killed now): %s\n", name, strings.Join(leftovers, ", "))
		if res.code == 0 {
			res.code = 1
		}
	}
	return res.code, res.err
}

// CleanLeftoverNetns kills the processes in, and deletes, every node network
// namespace whose creating process no longer exists.
func CleanLeftoverNetns(ctx context.Context, log io.Writer) {
	for _, name := range ListNodeNetns() {
		rest := strings.TrimPrefix(name, NetnsPrefix)
		pidStr, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidStr)
		if err == nil && processExists(pid) {
			continue // a run in progress, e.g. another package's tests
		}
		fmt.Fprintf(log, "e2eenv: removing leftover node netns %s of a crashed run\n", name)
		if procs, err := killNetnsPids(ctx, name); err != nil {
			fmt.Fprintf(log, "e2eenv: %v\n", err)
		} else if len(procs) > 0 {
			fmt.Fprintf(log, "e2eenv: killed leftover processes %s\n", strings.Join(procs, ", "))
		}
		if err := deleteNetns(ctx, name); err != nil {
			fmt.Fprintf(log, "e2eenv: %v\n", err)
		}
	}
}

// ListNodeNetns lists the named network namespaces with NetnsPrefix.
func ListNodeNetns() []string {
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return nil
	}
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), NetnsPrefix) {
			names = append(names, e.Name())
		}
	}
	return names
}

// killNetnsPids SIGKILLs every process in the named namespace and waits until
// none is left; it returns "pid(comm)" of each one found.
func killNetnsPids(ctx context.Context, name string) ([]string, error) {
	var found []string
	seen := map[string]bool{}
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := exec.CommandContext(ctx, "ip", "netns", "pids", name).Output()
		if err != nil {
			return found, fmt.Errorf("ip netns pids %s: %w", name, exitDetail(err))
		}
		pids := strings.Fields(string(out))
		if len(pids) == 0 {
			return found, nil
		}
		for _, p := range pids {
			pid, err := strconv.Atoi(p)
			if err != nil {
				continue
			}
			if !seen[p] {
				seen[p] = true
				comm, _ := os.ReadFile("/proc/" + p + "/comm")
				found = append(found, fmt.Sprintf("%d(%s)", pid, strings.TrimSpace(string(comm))))
			}
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if time.Now().After(deadline) {
			return found, fmt.Errorf("processes %v in netns %s survive SIGKILL", pids, name)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func deleteNetns(ctx context.Context, name string) error {
	out, err := exec.CommandContext(ctx, "ip", "netns", "del", name).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip netns del %s: %w: %s", name, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func processExists(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
