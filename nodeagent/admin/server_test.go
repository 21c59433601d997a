package admin

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambientd/ambientd/nodeagent/unixsock"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// helperEnv makes the test binary act as an admin client (see TestMain), so
// a test can ask the server from a process running as another uid.
const helperEnv = "ADMIN_TEST_HELPER_SOCKET"

func TestMain(m *testing.M) {
	if sock := os.Getenv(helperEnv); sock != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := NewClient(sock).Status(ctx)
		fmt.Printf("status err=%v\n", err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type fakeSource struct{}

func (fakeSource) NodeStatus(context.Context) NodeStatus {
	return NodeStatus{Node: "n1", Pods: []Pod{{Namespace: "ns", Name: "a", Phase: "enabled", ZtunnelAcked: true}}}
}

func (fakeSource) PodDetail(_ context.Context, namespace, name string) (PodDetail, error) {
	if name != "a" {
		return PodDetail{}, fmt.Errorf("%s/%s: %w", namespace, name, ErrNotFound)
	}
	return PodDetail{Pod: Pod{Namespace: "ns", Name: "a"}, Rules: "*nat\nCOMMIT\n"}, nil
}

// serve runs a server on a fresh socket until the test ends.
func serve(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "admin-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil { // the non-root helper must reach the socket
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "admin.sock")
	// As the daemon serves it: a 0600 socket, ConnContext, Handler.
	ln, _, err := unixsock.Listen(sock, "unix", 0o600)
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: Handler(fakeSource{}, nil), ConnContext: ConnContext}
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ln) }()
	t.Cleanup(func() {
		hs.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	})
	return sock
}

func TestStatusAndPod(t *testing.T) {
	testutil.RequireRoot(t)
	sock := serve(t)
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v (%v), want 0600", fi.Mode(), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := NewClient(sock)
	st, err := c.Status(ctx)
	if err != nil || st.Node != "n1" || len(st.Pods) != 1 || !st.Pods[0].ZtunnelAcked {
		t.Fatalf("Status = %+v, %v", st, err)
	}
	d, err := c.Pod(ctx, "ns", "a")
	if err != nil || d.Rules == "" {
		t.Errorf("Pod(ns/a) = %+v, %v", d, err)
	}
	if _, err := c.Pod(ctx, "ns", "b"); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "ns/b") {
		t.Errorf("Pod(ns/b) error %v; want ErrNotFound naming ns/b", err)
	}
}

func TestAgentDown(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for name, prepare := range map[string]func(string) error{
		"no socket file": func(string) error { return nil },
		// A socket file nobody listens on, as a killed agent leaves it.
		"stale socket": func(p string) error {
			fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
			if err != nil {
				return err
			}
			defer syscall.Close(fd)
			return syscall.Bind(fd, &syscall.SockaddrUnix{Name: p})
		},
	} {
		t.Run(name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "admin.sock")
			if err := prepare(sock); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			_, err := NewClient(sock).Status(ctx)
			if !errors.Is(err, ErrAgentDown) || !strings.Contains(err.Error(), "agent not running at "+sock) {
				t.Errorf("Status with no agent: %v; want ErrAgentDown naming %s", err, sock)
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("took %v", took)
			}
		})
	}
}

// A non-root peer is refused twice over: the 0600 mode stops its connect,
// and past the mode (CAP_DAC_OVERRIDE) SO_PEERCRED shows its uid.
func TestRefusesNonRootPeer(t *testing.T) {
	testutil.RequireRoot(t)
	sock := serve(t)
	run := func(caps []uintptr) string {
		t.Helper()
		return testutil.RunTestBinaryAs(t, 65534, 65534, caps, []string{helperEnv + "=" + sock})
	}
	if out := run(nil); !strings.Contains(out, "permission denied") {
		t.Errorf("unprivileged non-root peer: %q, want permission denied", out)
	}
	const capDacOverride = 1
	if out := run([]uintptr{capDacOverride}); !strings.Contains(out, "403 Forbidden") || !strings.Contains(out, "peer uid 65534 is not root") {
		t.Errorf("non-root peer with CAP_DAC_OVERRIDE: %q, want 403 naming uid 65534", out)
	}
}
