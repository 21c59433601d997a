package build

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Options tune Ensure.
type Options struct {
	// Root is the repository (default: RepoRoot).
	Root string
	// Log receives the progress lines (default os.Stderr).
	Log io.Writer
	// Rebuild rebuilds Ours and Image even when present: make targets test
	// the tree as it is now, never a stale bin/. Test programs leave it
	// false (their make target already rebuilt them).
	Rebuild bool
	// Name is what the user ran, for the first line and the advice on
	// failure (default "the build").
	Name string
	// MustExist builds nothing: a missing part is an error (the check that
	// a make target's ensure step built everything its program needs).
	MustExist bool
	// Heartbeat is how often a long step says it is still running
	// (default one minute).
	Heartbeat time.Duration
}

// Ensure builds the parts that are missing (and Ours and Image again with
// Rebuild), then checks that every part is in place and returns where
// everything is. It prints one line per step that takes time, with the
// elapsed time, and nothing when everything is already built.
func Ensure(ctx context.Context, parts []Part, opts Options) (Binaries, error) {
	if opts.Log == nil {
		opts.Log = os.Stderr
	}
	if opts.Name == "" {
		opts.Name = "the build"
	}
	if opts.Heartbeat == 0 {
		opts.Heartbeat = time.Minute
	}
	if opts.Root == "" {
		r, err := RepoRoot()
		if err != nil {
			return Binaries{}, err
		}
		opts.Root = r
	}
	b, err := Locate(opts.Root)
	if err != nil {
		return b, err
	}
	e := &ensurer{opts: opts, start: time.Now()}
	parts = sortedParts(parts)
	if opts.MustExist {
		for _, p := range parts {
			if b.missing(p) {
				return b, fmt.Errorf("%s is missing although %s should have built it", p.title(), opts.Name)
			}
		}
		return b, b.Check(parts...)
	}

	// The first line of a long first run: what is missing and how long it
	// takes on the machine this project measures on.
	var todo []string
	var estimate time.Duration
	for _, p := range parts {
		if p == Packages || p == NodePackages || !b.missing(p) {
			continue
		}
		todo = append(todo, p.short())
		estimate += cold[p]
		if isKube(p) && !e.modulesCounted {
			estimate += cold["modules"]
			e.modulesCounted = true
		}
	}
	if estimate > 3*time.Minute {
		fmt.Fprintf(opts.Log, "ensure: %s needs %s, not built yet: about %s on 2 cores with empty Go caches, once (later runs reuse .cache/; build logs in .cache/logs/)\n",
			opts.Name, strings.Join(todo, ", "), roundMinutes(estimate))
	}

	modulesDone := map[string]bool{} // by wrapper module
	for _, p := range parts {
		if err := ctx.Err(); err != nil {
			return b, err
		}
		switch {
		case p == Packages:
			err = e.step(ctx, p, false, func(ctx context.Context, log io.Writer) error {
				return e.run(ctx, log, opts.Root, nil, filepath.Join(opts.Root, "hack", "deps.sh"))
			})
		case p == NodePackages:
			err = e.step(ctx, p, b.missing(p), func(ctx context.Context, log io.Writer) error {
				return e.run(ctx, log, opts.Root, nil, filepath.Join(opts.Root, "hack", "deps.sh"), "node")
			})
			if err == nil {
				// Installed just now: find them on PATH.
				b, err = Locate(opts.Root)
			}
		case isKube(p):
			if !b.missing(p) {
				continue
			}
			var mod string
			if mod, _, err = kubeModule(opts.Root, p); err != nil {
				break
			}
			if !modulesDone[mod] {
				modulesDone[mod] = true
				if err = e.step(ctx, "modules", true, func(ctx context.Context, log io.Writer) error {
					return e.run(ctx, log, mod, kubeEnv(), "go", "mod", "download")
				}); err != nil {
					break
				}
			}
			err = e.locked(ctx, b, p, func(ctx context.Context, log io.Writer) error { return e.buildKube(ctx, log, b, p) })
		case p == Helm:
			if !b.missing(p) {
				continue
			}
			err = e.locked(ctx, b, p, func(ctx context.Context, log io.Writer) error { return e.buildHelm(ctx, log, b) })
		case p == CNIPlugins:
			if !b.missing(p) {
				continue
			}
			err = e.locked(ctx, b, p, func(ctx context.Context, log io.Writer) error { return e.buildCNIPlugins(ctx, log, b) })
		case p == Ours:
			if !opts.Rebuild && !b.missing(p) {
				continue
			}
			err = e.step(ctx, p, b.missing(p), func(ctx context.Context, log io.Writer) error {
				return BuildPrograms(ctx, log, opts.Root, filepath.Join(opts.Root, "bin"), "")
			})
		case p == Image:
			if !opts.Rebuild && !b.missing(p) {
				continue
			}
			err = e.step(ctx, p, b.missing(p), func(ctx context.Context, log io.Writer) error {
				return e.run(ctx, log, opts.Root, nil, filepath.Join(opts.Root, "hack", "image.sh"), b.Image)
			})
			if err == nil {
				// hack/image.sh's summary: reference, digest, size.
				fmt.Fprint(opts.Log, tail(filepath.Join(opts.Root, ".cache", "logs", string(Image)+".log"), 3))
			}
		}
		if err != nil {
			return b, err
		}
	}
	if len(todo) > 0 && estimate > 3*time.Minute {
		fmt.Fprintf(opts.Log, "ensure: [%s] everything %s needs is built\n", e.elapsed(), opts.Name)
	}
	return b, b.Check(parts...)
}

type ensurer struct {
	opts           Options
	start          time.Time
	modulesCounted bool
}

func (e *ensurer) elapsed() string {
	d := time.Since(e.start).Round(time.Second)
	return fmt.Sprintf("%2d:%02d", int(d.Minutes()), int(d.Seconds())%60)
}

func isKube(p Part) bool {
	for _, k := range kubeParts {
		if k == p {
			return true
		}
	}
	return false
}

// step runs one step with its output in .cache/logs/<name>.log. announce
// prints a line when it starts (the part was missing); every step that
// takes long prints heartbeats and a line when done.
func (e *ensurer) step(ctx context.Context, p Part, announce bool, fn func(ctx context.Context, log io.Writer) error) error {
	logDir := filepath.Join(e.opts.Root, ".cache", "logs")
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return err
	}
	logPath := filepath.Join(logDir, string(p)+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer f.Close()
	title := p.title()
	if announce {
		est := ""
		if d, ok := cold[p]; ok && d >= time.Minute {
			est = fmt.Sprintf(" (about %s cold)", roundMinutes(d))
		}
		verb := "building"
		if p == "modules" {
			verb = "fetching"
		}
		fmt.Fprintf(e.opts.Log, "ensure: [%s] %s %s%s\n", e.elapsed(), verb, title, est)
	}
	began := time.Now()
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(e.opts.Heartbeat)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				fmt.Fprintf(e.opts.Log, "ensure: [%s]   … still on %s (%s so far)\n", e.elapsed(), title, time.Since(began).Round(time.Second))
			}
		}
	}()
	err = fn(ctx, f)
	close(done)
	wg.Wait()
	took := time.Since(began).Round(time.Second)
	if err != nil {
		f.Sync()
		fmt.Fprintf(e.opts.Log, "ensure: [%s] FAILED: %s, after %s: %v\n%s", e.elapsed(), title, took, err, tail(logPath, 15))
		return fmt.Errorf("%s failed (full output: %s). %s", title, logPath, advice(p, e.opts.Name))
	}
	if announce || took >= 10*time.Second {
		fmt.Fprintf(e.opts.Log, "ensure: [%s] done: %s in %s\n", e.elapsed(), title, took)
	}
	return nil
}

// locked runs a build step under the repository's build lock, so parallel
// test binaries and scripts that all find a part missing build it once; the
// part is checked again once the lock is held.
func (e *ensurer) locked(ctx context.Context, b Binaries, p Part, fn func(ctx context.Context, log io.Writer) error) error {
	dir := filepath.Join(e.opts.Root, ".cache")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	lf, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer lf.Close()
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", lf.Name(), err)
	}
	defer syscall.Flock(int(lf.Fd()), syscall.LOCK_UN)
	if !b.missing(p) {
		return nil // another process built it while we waited
	}
	return e.step(ctx, p, true, fn)
}

// run runs a command with its output in log.
func (e *ensurer) run(ctx context.Context, log io.Writer, dir string, env []string, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	fmt.Fprintf(log, "$ %s %s\n", name, strings.Join(args, " "))
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w", filepath.Base(name), err)
	}
	return nil
}

func kubeEnv() []string {
	return []string{"CGO_ENABLED=0", "GOFLAGS=" + strings.TrimSpace(os.Getenv("GOFLAGS")+" -mod=readonly -buildvcs=false")}
}

// buildKube builds one binary of the wrapper module into a temporary name
// and renames it, so an interrupted build never leaves a half-written binary
// that a later check takes for a finished one.
func (e *ensurer) buildKube(ctx context.Context, log io.Writer, b Binaries, p Part) error {
	mod, kube, err := kubeModule(e.opts.Root, p)
	if err != nil {
		return err
	}
	dst := b.files(p)[0]
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(dst), "."+string(p)+".tmp")
	var args []string
	if p == Etcd {
		args = []string{"build", "-trimpath", "-ldflags=-s -w", "-o", tmp, "./etcd"}
	} else {
		v := strings.TrimPrefix(kube, "v")
		major, minor, _ := strings.Cut(v, ".")
		minor, _, _ = strings.Cut(minor, ".")
		ldflags := "-s -w -X k8s.io/component-base/version.gitVersion=" + kube +
			" -X k8s.io/component-base/version.gitMajor=" + major +
			" -X k8s.io/component-base/version.gitMinor=" + minor +
			" -X k8s.io/component-base/version.gitTreeState=clean"
		args = []string{"build", "-trimpath", "-ldflags=" + ldflags, "-o", tmp, "k8s.io/kubernetes/cmd/" + string(p)}
	}
	if err := e.run(ctx, log, mod, kubeEnv(), "go", args...); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, dst)
}

// buildHelm builds the helm command from the module test/helm pins (its
// go.mod's tool directive) into a temporary name and renames it.
func (e *ensurer) buildHelm(ctx context.Context, log io.Writer, b Binaries) error {
	if err := os.MkdirAll(filepath.Dir(b.Helm), 0o755); err != nil {
		return err
	}
	tmp := b.Helm + ".tmp"
	if err := e.run(ctx, log, filepath.Join(e.opts.Root, "test", "helm"), kubeEnv(), "go", "build", "-trimpath", "-ldflags=-s -w", "-o", tmp, "helm.sh/helm/v4/cmd/helm"); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, b.Helm)
}

// buildCNIPlugins builds the reference plugins into a temporary dir and
// moves them in place.
func (e *ensurer) buildCNIPlugins(ctx context.Context, log io.Writer, b Binaries) error {
	if err := os.MkdirAll(b.CNIRefDir, 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(b.CNIRefDir), ".build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := BuildCNIPlugins(ctx, log, e.opts.Root, tmp); err != nil {
		return err
	}
	for _, f := range b.files(CNIPlugins) {
		if err := os.Rename(filepath.Join(tmp, filepath.Base(f)), f); err != nil {
			return err
		}
	}
	return nil
}

// BuildCNIPlugins builds the CNI reference plugins (loopback, bridge,
// host-local), at the version go.mod pins, into dir.
func BuildCNIPlugins(ctx context.Context, log io.Writer, root, dir string) error {
	args := append([]string{"build", "-o", dir + "/"}, cniRefPlugins...)
	cmd := exec.CommandContext(ctx, goTool(), args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build the CNI reference plugins: %w", err)
	}
	return nil
}

// BuildPrograms builds Programs (or only those named) into dir, as `make
// build` does; version, when set, is stamped into the shipped ones.
func BuildPrograms(ctx context.Context, log io.Writer, root, dir, version string, names ...string) error {
	for _, p := range Programs {
		if len(names) > 0 && !slices.Contains(names, p.Name) {
			continue
		}
		out, err := filepath.Abs(filepath.Join(dir, p.Name))
		if err != nil {
			return err
		}
		args := p.buildArgs(out, version)
		cmd := exec.CommandContext(ctx, goTool(), args...)
		cmd.Dir = filepath.Join(root, p.Module)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		cmd.Stdout, cmd.Stderr = log, log
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("go build %s: %w", p.Package, err)
		}
	}
	return nil
}

// goTool is the go command: `go test` puts its own toolchain first on PATH.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return "go"
}

// advice says what a user can do when a step failed.
func advice(p Part, name string) string {
	again := fmt.Sprintf("then run %s again: what was built is kept in .cache/.", name)
	switch {
	case p == Packages || p == NodePackages:
		return "Installing Debian packages needs root and a working apt (apt-get update); " + again
	case p == Image:
		return "The image is assembled from Debian packages (apt-get download) and bin/: check apt's sources and free disk space; " + again
	default:
		return "Check that this machine reaches the Go module proxy (" + goproxy() + ") and has a few GB free on disk (df -h .cache); " + again
	}
}

func goproxy() string {
	if v := os.Getenv("GOPROXY"); v != "" {
		return "GOPROXY=" + v
	}
	out, err := exec.Command(goTool(), "env", "GOPROXY").Output()
	if err != nil {
		return "GOPROXY"
	}
	return "GOPROXY=" + strings.TrimSpace(string(out))
}

// tail returns the last n lines of a file, indented.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	var sb strings.Builder
	for _, l := range lines {
		sb.WriteString("    " + l + "\n")
	}
	return sb.String()
}

func roundMinutes(d time.Duration) string {
	m := int((d + 30*time.Second) / time.Minute)
	if m < 1 {
		return "a minute"
	}
	if m == 1 {
		return "1 minute"
	}
	return fmt.Sprintf("%d minutes", m)
}

// ErrUnknownTarget is returned for a target Targets does not list.
var ErrUnknownTarget = errors.New("unknown target")

// PartsOf returns what a target (a make target, or a single Part) needs.
func PartsOf(target string) ([]Part, error) {
	if parts, ok := Targets[target]; ok {
		return parts, nil
	}
	for _, p := range Node {
		if string(p) == target {
			return []Part{p}, nil
		}
	}
	return nil, fmt.Errorf("%w %q", ErrUnknownTarget, target)
}
