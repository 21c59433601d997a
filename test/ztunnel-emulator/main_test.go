package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
	"github.com/ambientd/ambientd/nodeagent/ztunnel"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

const testTimeout = 20 * time.Second

// The test binary doubles as the command, so the test runs the real main
// as a subprocess without a separate build.
func TestMain(m *testing.M) {
	if os.Getenv("ZTUNNEL_EMULATOR_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), "ZTUNNEL_EMULATOR_MAIN=1")
	return cmd
}

func TestCommandAgainstServer(t *testing.T) {
	testutil.RequireRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*testTimeout)
	defer cancel()
	nsFile, err := podnetns.Open(testutil.NewNetNSWith(t, testutil.NetNSOptions{LoDown: true, IgnoreRemovalErr: true}).NS.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nsFile.Close() })

	dir, err := os.MkdirTemp("", "zemu")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "ztunnel.sock")
	srv := ztunnel.NewServer(ztunnel.Config{SocketPath: sock}, slog.New(slog.DiscardHandler))
	srvCtx, stopSrv := context.WithCancel(ctx)
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Run(srvCtx, noSnapshot{}) }()
	defer func() { stopSrv(); <-srvDone }()

	cmd := command(ctx, "--socket", sock, "--netns-mode", "--status-addr", "127.0.0.1:0", "--nack", "ns/denied=go away")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// drained closes once the process exited and its log was read; waitErr
	// is then valid. Until then the goroutine may still call t.Log, so the
	// test must not return before it (the deferred kill makes sure).
	drained := make(chan struct{})
	var waitErr error
	defer func() {
		_ = cmd.Process.Kill()
		<-drained
	}()
	// Find the status address in the log, keep draining it afterwards.
	addrc := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`status API listening.*addr=(\S+)`)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			t.Log(sc.Text())
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				addrc <- m[1]
			}
		}
		waitErr = cmd.Wait()
		close(drained)
	}()
	var base string
	select {
	case a := <-addrc:
		base = "http://" + a
	case <-ctx.Done():
		t.Fatal("no status address logged")
	}

	testutil.Eventually(t, "the emulator to ack its snapshot", testTimeout, func() bool { return srv.Status().SnapshotAcked })
	// --nack from the command line.
	var nack *ztunnel.NackError
	err = srv.AddWorkload(ctx, ztunnel.Workload{UID: "u1", Name: "denied", Namespace: "ns"}, nsFile)
	if !errors.As(err, &nack) || nack.Message != "go away" {
		t.Fatalf("add of --nack'ed workload: %v", err)
	}
	// Nack and un-nack through the API.
	httpDo(t, "POST", base+"/nack?workload="+url.QueryEscape("ns/p")+"&error=nope", http.StatusNoContent)
	err = srv.AddWorkload(ctx, ztunnel.Workload{UID: "u2", Name: "p", Namespace: "ns", ServiceAccount: "sa"}, nsFile)
	if !errors.As(err, &nack) || nack.Message != "nope" {
		t.Fatalf("add after POST /nack: %v", err)
	}
	httpDo(t, "DELETE", base+"/nack?workload="+url.QueryEscape("ns/p"), http.StatusNoContent)
	if err := srv.AddWorkload(ctx, ztunnel.Workload{UID: "u2", Name: "p", Namespace: "ns", ServiceAccount: "sa"}, nsFile); err != nil {
		t.Fatal(err)
	}
	httpDo(t, "POST", base+"/nack", http.StatusBadRequest)

	var st ztunnelemu.State
	if err := json.Unmarshal(httpDo(t, "GET", base+"/state", http.StatusOK), &st); err != nil {
		t.Fatal(err)
	}
	w, ok := st.Workload("u2")
	if !ok || w.Namespace != "ns" || w.ServiceAccount != "sa" || len(w.Listeners) < 3 || !st.Connected {
		t.Fatalf("state: %+v", st)
	}
	if len(st.Requests) != 4 || st.Requests[1].AckError != "go away" {
		t.Fatalf("requests: %+v", st.Requests)
	}

	// SIGTERM: clean exit.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-drained:
		if waitErr != nil {
			t.Fatalf("exit after SIGTERM: %v", waitErr)
		}
	case <-ctx.Done():
		t.Fatal("emulator did not exit on SIGTERM")
	}
}

func TestCommandRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--status-addr", "0.0.0.0:0"},
		{"--nack", "no-equals-sign"},
		{"extra-arg"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		out, err := command(ctx, args...).CombinedOutput()
		cancel()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() == 0 {
			t.Fatalf("%v: want a non-zero exit, got %v: %s", args, err, out)
		}
		if !strings.Contains(string(out), "ztunnel-emulator") && !strings.Contains(string(out), "invalid") {
			t.Fatalf("%v: unclear error: %s", args, out)
		}
	}
}

func httpDo(t *testing.T, method, u string, want int) []byte {
	t.Helper()
	req, err := http.NewRequest(method, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Timeout: testTimeout}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("%s %s: %s %s", method, u, resp.Status, b)
	}
	return b
}

// noSnapshot is a snapshot source with no pods.
type noSnapshot struct{}

func (noSnapshot) Snapshot() []ztunnel.SnapshotEntry { return nil }
func (noSnapshot) SnapshotRefused(string, error)     {}
func (noSnapshot) Readd(string, func(error))         {}
