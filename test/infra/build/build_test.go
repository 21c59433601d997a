package build

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

func TestRequiredVersion(t *testing.T) {
	gomod := filepath.Join(t.TempDir(), "go.mod")
	os.WriteFile(gomod, []byte("module x\n\nrequire k8s.io/kubernetes v1.37.2\n\nrequire (\n\tgo.etcd.io/etcd/server/v3 v3.7.0 // indirect\n)\n"), 0o644)
	for mod, want := range map[string]string{"k8s.io/kubernetes": "v1.37.2", "go.etcd.io/etcd/server/v3": "v3.7.0"} {
		if got, err := requiredVersion(gomod, mod); err != nil || got != want {
			t.Errorf("requiredVersion(%s) = %q, %v; want %q", mod, got, err, want)
		}
	}
	if _, err := requiredVersion(gomod, "example.com/absent"); err == nil {
		t.Error("absent module: no error")
	}
}

// TestTargetsEnsureThemselves: every make target in Targets builds what it
// needs through its own entry in Targets, first — in the Makefile's recipe or
// in the hack script the recipe runs — so running it alone on a fresh clone
// builds what its program then needs (the bug of `make demo` on a fresh
// machine: its script never built the CNI reference plugins).
func TestTargetsEnsureThemselves(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	recipes := makeRecipes(string(mk))
	ensureCall := regexp.MustCompile(`(?:\$\(ENSURE\)|go run \./hack/ensure(?: -name "[^"]*")?) ([a-z0-9-]+)\b`)
	for target := range Targets {
		t.Run(target, func(t *testing.T) {
			recipe, ok := recipes[target]
			if !ok {
				t.Fatalf("Makefile has no target %s", target)
			}
			// The recipe itself, or the hack script it runs first.
			text := recipe
			if m := regexp.MustCompile(`^\s*(?:\S+=\S+\s+)*(hack/[a-z0-9-]+\.sh)`).FindStringSubmatch(firstLine(recipe)); m != nil {
				b, err := os.ReadFile(filepath.Join(root, m[1]))
				if err != nil {
					t.Fatal(err)
				}
				text = string(b)
			}
			calls := ensureCall.FindAllStringSubmatch(text, -1)
			if len(calls) == 0 {
				t.Fatalf("make %s never runs hack/ensure:\n%s", target, text)
			}
			if calls[0][1] != target {
				t.Errorf("make %s ensures %q, not its own target", target, calls[0][1])
			}
		})
	}
	// And every target that runs a program is in Targets.
	for target, recipe := range recipes {
		if strings.Contains(recipe, "go test") || strings.Contains(recipe, "hack/") && !strings.Contains(recipe, "hack/fresh-check.sh") &&
			!strings.Contains(recipe, "hack/deps.sh") && !strings.Contains(recipe, "hack/generate.sh") {
			if _, ok := Targets[target]; !ok {
				t.Errorf("make %s runs a program but test/infra/build.Targets does not say what it needs", target)
			}
		}
	}
}

// makeRecipes returns each Makefile target's recipe lines.
func makeRecipes(mk string) map[string]string {
	out := map[string]string{}
	var cur string
	for _, line := range strings.Split(mk, "\n") {
		switch {
		case strings.HasPrefix(line, "\t") && cur != "":
			out[cur] += strings.TrimPrefix(strings.TrimPrefix(line, "\t"), "@") + "\n"
		case regexp.MustCompile(`^[a-z0-9-]+:`).MatchString(line):
			cur = line[:strings.Index(line, ":")]
			out[cur] += ""
		default:
			cur = ""
		}
	}
	return out
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}

// TestPartsOrder: the build order puts the packages first and the image (it
// contains bin/) last, whatever order a target lists.
func TestPartsOrder(t *testing.T) {
	got := sortedParts([]Part{Image, Ours, KubeAPIServer, Packages, Etcd, Ours})
	want := []Part{Packages, Etcd, KubeAPIServer, Ours, Image}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("order %v, want %v", got, want)
	}
	for name, parts := range Targets {
		if len(sortedParts(parts)) != len(parts) {
			t.Errorf("target %s lists a part twice or one the build order does not know: %v", name, parts)
		}
	}
}

// TestCheckSaysWhatToRun: a part that is not built is named with what to
// run, never with a function of ours.
func TestCheckSaysWhatToRun(t *testing.T) {
	root := t.TempDir()
	b := Binaries{CNIRefDir: filepath.Join(root, "cni"), KubeAPIServer: filepath.Join(root, "kube-apiserver")}
	err := b.Check(CNIPlugins)
	if err == nil {
		t.Fatal("missing CNI plugins: no error")
	}
	msg := err.Error()
	for _, want := range []string{"CNI reference plugins", "not built yet", "run the make target again", "go run ./hack/ensure cni-plugins"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not say %q", msg, want)
		}
	}
	if regexp.MustCompile(`[A-Z][a-zA-Z]+\.[A-Z][a-zA-Z]+\(|Ensure|Locate`).MatchString(msg) {
		t.Errorf("error %q names internal functions", msg)
	}
}

// TestStepProgressAndFailure: a long step prints heartbeats with the elapsed
// time; a failing one prints the end of its log, where the whole log is, and
// what to do — no internal function names.
func TestStepProgressAndFailure(t *testing.T) {
	root := t.TempDir()
	var out bytes.Buffer
	e := &ensurer{opts: Options{Root: root, Log: &out, Name: "make demo", Heartbeat: 20 * time.Millisecond}, start: time.Now()}
	err := e.step(context.Background(), KubeAPIServer, true, func(ctx context.Context, log io.Writer) error {
		for i := 0; i < 30; i++ {
			fmt.Fprintf(log, "go: downloading example.com/m%d v1.0.0\n", i)
		}
		time.Sleep(90 * time.Millisecond)
		fmt.Fprintln(log, "compile: disk full")
		return errors.New("go: exit status 1")
	})
	if err == nil {
		t.Fatal("no error")
	}
	o := out.String()
	for _, want := range []string{"building kube-apiserver (about 9 minutes cold)", "still on kube-apiserver", "FAILED: kube-apiserver", "compile: disk full"} {
		if !strings.Contains(o, want) {
			t.Errorf("progress output lacks %q:\n%s", want, o)
		}
	}
	if strings.Count(o, "go: downloading") > 15 {
		t.Errorf("the whole build log was printed, not its end:\n%s", o)
	}
	if !regexp.MustCompile(`^ensure: \[ 0:00\] building`).MatchString(o) {
		t.Errorf("progress lines do not start with the elapsed time:\n%s", o)
	}
	msg := err.Error()
	for _, want := range []string{filepath.Join(root, ".cache", "logs", "kube-apiserver.log"), "Go module proxy", "run make demo again", "what was built is kept"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not say %q", msg, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(root, ".cache", "logs", "kube-apiserver.log")); !bytes.Contains(b, []byte("m29 v1.0.0")) {
		t.Errorf("the log file lacks the build output")
	}
}

// TestMustExist: the check-only mode builds nothing and names what is
// missing as a failure of the target that should have built it.
func TestMustExist(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvKubeBinDir, t.TempDir()) // empty: nothing built there
	var out bytes.Buffer
	_, err = Ensure(context.Background(), []Part{Etcd}, Options{Root: root, Log: &out, MustExist: true, Name: "make e2e"})
	if err == nil || !strings.Contains(err.Error(), "etcd is missing although make e2e should have built it") {
		t.Fatalf("err = %v", err)
	}
	if out.Len() != 0 {
		t.Errorf("check-only printed build progress:\n%s", out.String())
	}
}

// TestOlderRelease: with AMBIENTD_KUBE_RELEASE the apiserver and the
// node's components come from that release's wrapper module and cache dir,
// stamped with its version, while etcd and kubectl stay the current
// release's; a release with no wrapper module is refused with the ones
// there are.
func TestOlderRelease(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	current, err := Locate(root)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvKubeRelease, "1.35")
	b, err := Locate(root)
	if err != nil {
		t.Fatal(err)
	}
	older := filepath.Join(root, ".cache", "kube", "v1.35.4")
	for _, p := range []Part{KubeAPIServer, Kubelet, ControllerManager, Scheduler} {
		if got := filepath.Dir(b.files(p)[0]); got != older {
			t.Errorf("%s in %s, want %s", p, got, older)
		}
		mod, v, err := kubeModule(root, p)
		if err != nil || mod != filepath.Join(root, "hack", "kube-1.35") || v != "v1.35.4" {
			t.Errorf("%s built from %s at %s (%v), want hack/kube-1.35 at v1.35.4", p, mod, v, err)
		}
	}
	for _, p := range []Part{Etcd, Kubectl} {
		if got, want := b.files(p)[0], current.files(p)[0]; got != want {
			t.Errorf("%s at %s, want the current release's %s", p, got, want)
		}
		if mod, _, err := kubeModule(root, p); err != nil || mod != filepath.Join(root, "hack", "kube") {
			t.Errorf("%s built from %s (%v), want hack/kube", p, mod, err)
		}
	}
	t.Setenv(EnvKubeRelease, "1.20")
	if _, err := Locate(root); err == nil || !strings.Contains(err.Error(), "no wrapper module hack/kube-1.20") || !strings.Contains(err.Error(), "1.35") {
		t.Errorf("unknown release: %v", err)
	}
}
