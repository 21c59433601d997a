package cniserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

// helperEnv makes the test binary act as a CNI API client (see TestMain), so
// a test can call the server from a process with another uid.
const helperEnv = "CNISERVER_TEST_HELPER_SOCKET"

func TestMain(m *testing.M) {
	if sock := os.Getenv(helperEnv); sock != "" {
		os.Exit(helperClient(sock))
	}
	os.Exit(m.Run())
}

// helperClient calls Health.Check and AddPod and prints their codes.
func helperClient(sock string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println("dial error:", err)
		return 2
	}
	defer conn.Close()
	_, herr := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	_, aerr := cniapi.NewCNIEventsClient(conn).AddPod(ctx, &cniapi.AddPodRequest{Pod: &cniapi.Pod{Name: "p", Namespace: "ns", NetnsPath: "/proc/self/ns/net"}})
	fmt.Printf("health=%s add=%s msg=%s\n", status.Code(herr), status.Code(aerr), status.Convert(aerr).Message())
	return 0
}

// recorder is a Handler that records events and answers as told.
type recorder struct {
	mu      sync.Mutex
	adds    []agent.PodEvent
	dels    []agent.PodEvent
	outcome agent.Outcome
	err     error
	block   bool // wait for ctx to end, then return its error
}

func (r *recorder) HandleAdd(ctx context.Context, ev agent.PodEvent) (agent.Outcome, error) {
	r.mu.Lock()
	r.adds = append(r.adds, ev)
	out, err, block := r.outcome, r.err, r.block
	r.mu.Unlock()
	if block {
		<-ctx.Done()
		return agent.OutcomeUnknown, ctx.Err()
	}
	return out, err
}

func (r *recorder) HandleDel(ctx context.Context, ev agent.PodEvent) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dels = append(r.dels, ev)
	return r.err
}

// startServer runs a Server on a fresh socket and stops it at cleanup,
// checking Run's result and that the socket is gone.
func startServer(t *testing.T, h Handler, cfg Config) (*Server, func()) {
	t.Helper()
	if cfg.SocketPath == "" {
		cfg.SocketPath = filepath.Join(t.TempDir(), "run", "cni.sock")
	}
	s := New(cfg, h, nil)
	stopRun := testutil.Run(t, s.Run)
	testutil.WaitFor(t, "server serving", func() bool { return s.Serving() })
	stop := sync.OnceFunc(func() {
		stopRun()
		if s.Serving() {
			t.Error("Serving() still true after Run returned")
		}
		if _, err := os.Lstat(cfg.SocketPath); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket left behind after Run returned: %v", err)
		}
	})
	t.Cleanup(stop)
	return s, stop
}

func dial(t *testing.T, sock string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial %s: %v", sock, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestAddDelRoundTrip(t *testing.T) {
	testutil.RequireRoot(t) // SO_PEERCRED: the test process must be root to be accepted
	rec := &recorder{outcome: agent.Enrolled}
	s, _ := startServer(t, rec, Config{})
	c := cniapi.NewCNIEventsClient(dial(t, s.cfg.SocketPath))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	pod := &cniapi.Pod{
		Name: "web-0", Namespace: "shop", Uid: "6c1f0f4e-uid", InfraContainerId: "abc123",
		NetnsPath: "/var/run/netns/cni-1", Ips: []string{"10.1.0.7/24", "fd00::7/64"}, Interface: "eth0",
	}
	callStart := time.Now()
	timings := &cniapi.PluginTimings{InitNanos: int64(3 * time.Millisecond), ConfigNanos: int64(time.Millisecond), CallStartUnixNano: callStart.UnixNano()}
	resp, err := c.AddPod(ctx, &cniapi.AddPodRequest{Pod: pod, Timings: timings})
	if err != nil {
		t.Fatalf("AddPod: %v", err)
	}
	if resp.GetOutcome() != cniapi.Outcome_OUTCOME_ENROLLED {
		t.Errorf("outcome = %v, want ENROLLED", resp.GetOutcome())
	}
	if d := time.Duration(resp.GetAgentNanos()); d <= 0 || d > time.Since(callStart) {
		t.Errorf("agent time in the answer %v, want within the call (%v)", d, time.Since(callStart))
	}
	if _, err := c.DelPod(ctx, &cniapi.DelPodRequest{Pod: &cniapi.Pod{Name: "web-0", Namespace: "shop", Uid: "6c1f0f4e-uid"}}); err != nil {
		t.Fatalf("DelPod: %v", err)
	}

	want := agent.PodEvent{
		Name: "web-0", Namespace: "shop", UID: "6c1f0f4e-uid", InfraContainerID: "abc123",
		NetnsPath: "/var/run/netns/cni-1", Interface: "eth0",
		IPs: []netip.Prefix{netip.MustParsePrefix("10.1.0.7/24"), netip.MustParsePrefix("fd00::7/64")},
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.adds) == 1 {
		// The plugin's timings reach the handler as sent, with when the
		// call arrived (compared apart from the pod's identity).
		got := rec.adds[0]
		if got.Plugin.Init != 3*time.Millisecond || got.Plugin.Config != time.Millisecond || !got.Plugin.CallStart.Equal(time.Unix(0, callStart.UnixNano())) ||
			got.Received.Before(got.Plugin.CallStart) || got.Received.After(time.Now()) {
			t.Errorf("plugin timings %+v received %v: want init 3ms, config 1ms, call start %v, received after it", got.Plugin, got.Received, callStart)
		}
		rec.adds[0].Plugin, rec.adds[0].Received = want.Plugin, want.Received
	}
	if len(rec.adds) != 1 || fmt.Sprint(rec.adds[0]) != fmt.Sprint(want) {
		t.Errorf("adds = %+v, want [%+v]", rec.adds, want)
	}
	if len(rec.dels) != 1 || rec.dels[0].UID != "6c1f0f4e-uid" || rec.dels[0].NetnsPath != "" {
		t.Errorf("dels = %+v", rec.dels)
	}
}

// pluginRequests reads istio_cni_plugin_requests_total by response_code.
func pluginRequests(t *testing.T, m *istiometrics.Metrics) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := m.Register(reg, istiometrics.Sources{}); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != istiometrics.PluginRequestsName {
			continue
		}
		for _, m := range f.GetMetric() {
			got[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	return got
}

func TestAddAnswers(t *testing.T) {
	testutil.RequireRoot(t)
	okPod := &cniapi.Pod{Name: "p", Namespace: "ns", NetnsPath: "/proc/1/ns/net", Ips: []string{"10.0.0.1/32"}}
	tests := []struct {
		name        string
		h           *recorder
		pod         *cniapi.Pod
		wantOutcome cniapi.Outcome
		wantCode    codes.Code
		wantMsg     string
		// istio is the response_code counted under Istio's
		// istio_cni_plugin_requests_total ("": not counted, as Istio's
		// plugin never asks its agent about a pod out of the mesh).
		istio string
	}{
		{"enrolled", &recorder{outcome: agent.Enrolled}, okPod, cniapi.Outcome_OUTCOME_ENROLLED, codes.OK, "", "200"},
		{"pending", &recorder{outcome: agent.Pending}, okPod, cniapi.Outcome_OUTCOME_PENDING, codes.OK, "", "200"},
		{"not in mesh", &recorder{outcome: agent.NotInMesh}, okPod, cniapi.Outcome_OUTCOME_NOT_IN_MESH, codes.OK, "", ""},
		{"sidecar", &recorder{outcome: agent.SidecarCaptured}, okPod, cniapi.Outcome_OUTCOME_SIDECAR, codes.OK, "", ""},
		{"no outcome is a handler bug", &recorder{}, okPod, 0, codes.Internal, "without an error", "500"},
		{"plain error", &recorder{err: errors.New("apply in-pod rules: iptables-restore: exit 4")}, okPod, 0, codes.Internal, "iptables-restore: exit 4", "500"},
		{"status error keeps its code", &recorder{err: status.Error(codes.FailedPrecondition, "pod has no netns")}, okPod, 0, codes.FailedPrecondition, "pod has no netns", "500"},
		{"wrapped deadline", &recorder{err: fmt.Errorf("wait for ztunnel: %w", context.DeadlineExceeded)}, okPod, 0, codes.DeadlineExceeded, "wait for ztunnel", "500"},
		// The agent's domain errors, wrapped as the core wraps them, reach the
		// plugin as these codes (errors.Is across the boundary).
		{"pod unknown", &recorder{err: fmt.Errorf("pod ns/p not found (waited 10s): %w", agent.ErrPodUnknown)}, okPod, 0, codes.NotFound, "pod ns/p not found", "500"},
		{"api unavailable", &recorder{err: fmt.Errorf("lookup: %w: %w", agent.ErrAPIUnavailable, errors.New("connection refused"))}, okPod, 0, codes.Unavailable, "connection refused", "500"},
		{"invalid pod", &recorder{err: fmt.Errorf("pod ns/p: %w: bad dns-capture", agent.ErrInvalidPod)}, okPod, 0, codes.InvalidArgument, "bad dns-capture", "400"},
		{"netns unusable", &recorder{err: fmt.Errorf("pod ns/p: %w: netns %q", agent.ErrNetnsUnusable, "/x")}, okPod, 0, codes.InvalidArgument, "netns", "400"},
		{"not captured", &recorder{err: fmt.Errorf("%w: program in-pod rules: boom", agent.ErrNotCaptured)}, okPod, 0, codes.Internal, "boom", "500"},
		{"pending with fail-pending", &recorder{err: fmt.Errorf("pod ns/p: %w (--fail-pending is set)", fmt.Errorf("%w: nack", agent.ErrPending))}, okPod, 0, codes.Unavailable, "--fail-pending", "500"},
		{"no pod", &recorder{outcome: agent.Enrolled}, nil, 0, codes.InvalidArgument, "no pod", "400"},
		{"no namespace", &recorder{outcome: agent.Enrolled}, &cniapi.Pod{Name: "p", NetnsPath: "/x"}, 0, codes.InvalidArgument, "name and namespace", "400"},
		{"no netns", &recorder{outcome: agent.Enrolled}, &cniapi.Pod{Name: "p", Namespace: "ns"}, 0, codes.InvalidArgument, "netns path", "400"},
		{"bad ip", &recorder{outcome: agent.Enrolled}, &cniapi.Pod{Name: "p", Namespace: "ns", NetnsPath: "/x", Ips: []string{"10.0.0.300/8"}}, 0, codes.InvalidArgument, "bad IP", "400"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			im := istiometrics.New()
			s, _ := startServer(t, tt.h, Config{Istio: im})
			c := cniapi.NewCNIEventsClient(dial(t, s.cfg.SocketPath))
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			resp, err := c.AddPod(ctx, &cniapi.AddPodRequest{Pod: tt.pod})
			if got := status.Code(err); got != tt.wantCode {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.wantCode)
			}
			if err != nil && !strings.Contains(status.Convert(err).Message(), tt.wantMsg) {
				t.Errorf("message %q does not contain %q", status.Convert(err).Message(), tt.wantMsg)
			}
			if err == nil && resp.GetOutcome() != tt.wantOutcome {
				t.Errorf("outcome = %v, want %v", resp.GetOutcome(), tt.wantOutcome)
			}
			want := map[string]float64{"200": 0, "400": 0, "500": 0}
			if tt.istio != "" {
				want[tt.istio] = 1
			}
			if got := pluginRequests(t, im); !maps.Equal(got, want) {
				t.Errorf("istio_cni_plugin_requests_total by response_code = %v, want %v", got, want)
			}
		})
	}
}

// The handler sees the caller's deadline, and a caller that gives up frees the
// handler and leaves no goroutines behind.
func TestDeadlinePropagatesAndNothingLeaks(t *testing.T) {
	testutil.RequireRoot(t)
	// The runtime's netpoller keeps its fds for good once created: create
	// it before taking the baseline.
	if ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "warm.sock")); err == nil {
		ln.Close()
	}
	before := runtime.NumGoroutine()
	fdsBefore := testutil.CountFDs(t)
	rec := &recorder{block: true}
	s, stop := startServer(t, rec, Config{})
	conn := dial(t, s.cfg.SocketPath)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := cniapi.NewCNIEventsClient(conn).AddPod(ctx, &cniapi.AddPodRequest{Pod: &cniapi.Pod{Name: "p", Namespace: "ns", NetnsPath: "/x"}})
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("AddPod against a blocking handler: %v, want DeadlineExceeded", err)
	}
	conn.Close()
	stop()
	testutil.WaitFor(t, "goroutines to return to baseline", func() bool { return runtime.NumGoroutine() <= before })
	testutil.WaitFor(t, "fds to return to baseline", func() bool { return testutil.CountFDs(t) <= fdsBefore })
}

func TestSocketLifecycle(t *testing.T) {
	testutil.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "ambientd")
	sock := filepath.Join(dir, "cni.sock")

	// A socket left by a dead agent: bound, never unlinked.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	if c, err := net.Dial("unix", sock); err == nil {
		c.Close()
		t.Fatal("stale socket accepts connections; the test needs a dead one")
	}

	s, stop := startServer(t, &recorder{outcome: agent.NotInMesh}, Config{SocketPath: sock})
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatalf("socket: %v", err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode = %v, want a socket with 0600", fi.Mode())
	}

	// The health calls below succeeding shows a live socket replaced the dead one.
	hc := healthpb.NewHealthClient(dial(t, s.cfg.SocketPath))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, svc := range []string{"", cniapi.HealthService} {
		resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q = %v, %v; want SERVING", svc, resp.GetStatus(), err)
		}
	}
	if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("health of unknown service: %v, want NotFound", err)
	}
	stop() // checks that Run returned nil and removed the socket
}

func TestRefusesNonSocketPath(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cni.sock")
	if err := os.WriteFile(path, []byte("not a socket"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := New(Config{SocketPath: path}, &recorder{}, nil).Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Run on a regular file: %v, want a 'not a socket' error", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "not a socket" {
		t.Error("Run clobbered a regular file")
	}
}

// A non-root process is refused twice over: the 0600 mode stops its connect,
// and when it gets past the mode anyway (CAP_DAC_OVERRIDE) SO_PEERCRED shows
// its uid and every call, health included, gets PermissionDenied.
func TestRefusesNonRootPeer(t *testing.T) {
	testutil.RequireRoot(t)
	rec := &recorder{outcome: agent.Enrolled}
	s, _ := startServer(t, rec, Config{})

	run := func(caps []uintptr) string {
		t.Helper()
		return testutil.RunTestBinaryAs(t, 65534, 65534, caps, []string{helperEnv + "=" + s.cfg.SocketPath})
	}

	// Without privileges the socket's mode keeps the peer out.
	if out := run(nil); !strings.Contains(out, "health=Unavailable") || !strings.Contains(out, "permission denied") {
		t.Errorf("unprivileged non-root peer: %q, want Unavailable with permission denied", out)
	}
	// Past the mode, SO_PEERCRED refuses it.
	const capDacOverride = 1
	out := run([]uintptr{capDacOverride})
	if !strings.Contains(out, "health=PermissionDenied add=PermissionDenied") || !strings.Contains(out, "peer uid 65534") {
		t.Errorf("non-root peer with CAP_DAC_OVERRIDE: %q, want PermissionDenied naming uid 65534", out)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.adds) != 0 {
		t.Errorf("handler saw %d adds from a non-root peer", len(rec.adds))
	}
}

func TestRunTwice(t *testing.T) {
	testutil.RequireRoot(t)
	s, _ := startServer(t, &recorder{}, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Run(ctx); err == nil {
		t.Fatal("second Run succeeded")
	}
}

func TestOutcomeLogsAsName(t *testing.T) {
	for o, want := range map[agent.Outcome]string{agent.Enrolled: "enrolled", agent.Pending: "pending", agent.NotInMesh: "not-in-mesh", agent.OutcomeUnknown: "Outcome(0)", agent.Outcome(7): "Outcome(7)"} {
		if got := o.String(); got != want {
			t.Errorf("Outcome(%d).String() = %q, want %q", int(o), got, want)
		}
		var buf bytes.Buffer
		slog.New(slog.NewJSONHandler(&buf, nil)).Info("x", "outcome", o)
		if !strings.Contains(buf.String(), `"outcome":"`+want+`"`) {
			t.Errorf("JSON log of Outcome(%d) = %s, want \"outcome\":%q", int(o), buf.String(), want)
		}
	}
}
