package e2eenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// spawner starts child processes from one goroutine locked to one OS thread
// that lives as long as the spawner. Children get Pdeathsig=SIGKILL, which the
// kernel delivers when the *thread* that forked them exits; forking from an
// arbitrary goroutine would tie a child's life to whatever thread happened to
// run it, and Go ends threads that a goroutine left locked (netns code does
// that on purpose), which would kill etcd in the middle of a test.
type spawner struct {
	reqs chan spawnReq
	done chan struct{}
	once sync.Once
}

type spawnReq struct {
	start func() error
	errc  chan error
}

func newSpawner() *spawner {
	s := &spawner{reqs: make(chan spawnReq), done: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		// Never unlocked: the thread must outlive every child it forked, and
		// it ends with the process (or when close below ends the goroutine,
		// after every child was stopped).
		close(ready)
		for {
			select {
			case r := <-s.reqs:
				r.errc <- r.start()
			case <-s.done:
				return
			}
		}
	}()
	<-ready
	return s
}

func (s *spawner) run(start func() error) error {
	r := spawnReq{start: start, errc: make(chan error, 1)}
	select {
	case s.reqs <- r:
		return <-r.errc
	case <-s.done:
		return errors.New("e2eenv: environment closed, cannot start processes")
	}
}

func (s *spawner) close() { s.once.Do(func() { close(s.done) }) }

// Process is a subprocess of the environment (etcd, kube-apiserver, the agent,
// the ztunnel emulator). Its stdout and stderr go to LogPath, appended across
// restarts, so a failing test can show them (see LogOnFailure).
type Process struct {
	Name    string   // short name for messages, e.g. "agent"
	Path    string   // binary
	Args    []string // arguments without argv[0]
	Env     []string // extra environment, appended to the test's
	LogPath string

	sp *spawner

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error
	starts  int
}

func newProcess(sp *spawner, name, path, logPath string, args ...string) *Process {
	return &Process{Name: name, Path: path, Args: args, LogPath: logPath, sp: sp}
}

// Start starts the process. It fails if it is already running.
func (p *Process) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && !isClosed(p.exited) {
		return fmt.Errorf("%s: already running as pid %d", p.Name, p.cmd.Process.Pid)
	}
	logf, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("%s: open log: %w", p.Name, err)
	}
	p.starts++
	fmt.Fprintf(logf, "===== %s start #%d at %s: %s %s\n", p.Name, p.starts, time.Now().Format(time.RFC3339Nano), p.Path, strings.Join(p.Args, " "))
	cmd := exec.Command(p.Path, p.Args...)
	cmd.Env = append(os.Environ(), p.Env...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := p.sp.run(cmd.Start); err != nil {
		logf.Close()
		return fmt.Errorf("%s: start %s: %w", p.Name, p.Path, err)
	}
	exited := make(chan struct{})
	p.cmd, p.exited = cmd, exited
	go func() {
		err := cmd.Wait()
		logf.Close()
		p.mu.Lock()
		p.waitErr = err
		p.mu.Unlock()
		close(exited)
	}()
	return nil
}

// Pid is the pid of the current (or last) run, 0 before the first start.
func (p *Process) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Exited is closed when the current run ends. Nil before the first start.
func (p *Process) Exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

// Running reports whether the process has been started and not yet exited.
func (p *Process) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil && !isClosed(p.exited)
}

// ExitError is the error from the last run's wait (nil for exit status 0 or
// while running).
func (p *Process) ExitError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waitErr
}

// Signal sends sig to the running process.
func (p *Process) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || isClosed(p.exited) {
		return fmt.Errorf("%s: not running", p.Name)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("%s: signal %v to pid %d: %w", p.Name, sig, p.cmd.Process.Pid, err)
	}
	return nil
}

// Stop sends SIGTERM and waits up to grace for the exit, then SIGKILLs. It is
// a no-op when the process is not running. The exit status is not an error:
// a process killed on purpose exits non-zero.
func (p *Process) Stop(grace time.Duration) error {
	return p.stop(syscall.SIGTERM, grace)
}

// Kill sends SIGKILL (no chance to clean up, as after an OOM kill or a node
// agent crash) and waits for the exit.
func (p *Process) Kill() error {
	return p.stop(syscall.SIGKILL, 0)
}

func (p *Process) stop(sig syscall.Signal, grace time.Duration) error {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil || isClosed(exited) {
		return nil
	}
	// The whole process group: a child of ours that forks (kube-apiserver
	// does not, but the agent could exec helpers) leaves nothing behind.
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	if sig != syscall.SIGKILL {
		select {
		case <-exited:
			return nil
		case <-time.After(grace):
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	select {
	case <-exited:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("%s: pid %d did not exit 30s after SIGKILL", p.Name, cmd.Process.Pid)
	}
}

// Restart stops the process (SIGTERM, grace) and starts it again with the
// same arguments.
func (p *Process) Restart(grace time.Duration) error {
	if err := p.Stop(grace); err != nil {
		return err
	}
	return p.Start()
}

// Logs returns the captured output of every run so far.
func (p *Process) Logs() string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return fmt.Sprintf("(cannot read %s log %s: %v)", p.Name, p.LogPath, err)
	}
	return string(b)
}

// LogTail returns the last n lines of the captured output.
func (p *Process) LogTail(n int) string {
	lines := strings.Split(strings.TrimRight(p.Logs(), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// LogOnFailure prints the process's captured output (last 300 lines) at the
// end of t when t failed.
func (p *Process) LogOnFailure(t testing.TB) {
	t.Helper()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("----- %s log (%s), last 300 lines -----\n%s\n----- end of %s log -----", p.Name, p.LogPath, p.LogTail(300), p.Name)
		}
	})
}

// WaitUntil polls check every interval until it returns true, ctx ends (the
// error has check's last error), or the process exits (reported with its
// log tail).
func (p *Process) WaitUntil(ctx context.Context, what string, interval time.Duration, check func(context.Context) (bool, error)) error {
	var lastErr error
	for {
		ok, err := check(ctx)
		if ok {
			return nil
		}
		lastErr = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: waiting for %s: %w (last error: %v)\n%s log tail:\n%s", p.Name, what, ctx.Err(), lastErr, p.Name, p.LogTail(40))
		case <-p.Exited():
			return fmt.Errorf("%s: exited (%v) while waiting for %s; log tail:\n%s", p.Name, p.ExitError(), what, p.LogTail(40))
		case <-time.After(interval):
		}
	}
}

func isClosed(c chan struct{}) bool {
	if c == nil {
		return false
	}
	select {
	case <-c:
		return true
	default:
		return false
	}
}
