package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ambientd/ambientd/cniapi"
)

func TestParseConfig(t *testing.T) {
	prev := `,"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]}`
	tests := []struct {
		name        string
		in          string
		wantErrCode uint // 0: no error
		wantErr     string
		check       func(t *testing.T, c *Config)
	}{
		{"defaults", `{"cniVersion":"1.0.0","name":"n","type":"ambientd-cni"}`, 0, "", func(t *testing.T, c *Config) {
			if c.AgentSocket != cniapi.DefaultSocketPath || c.timeout != cniapi.DefaultPluginTimeout || c.logLevel != slog.LevelInfo || c.PrevResult != nil {
				t.Errorf("defaults: socket %q timeout %v level %v prev %v", c.AgentSocket, c.timeout, c.logLevel, c.PrevResult)
			}
		}},
		{"all fields", `{"cniVersion":"1.0.0","name":"n","type":"ambientd-cni","agentSocket":"/run/a.sock","timeout":"1500ms",
			"excludeNamespaces":["kube-system","istio-system"],"logLevel":"DEBUG","logFile":"/var/log/x.log"` + prev + `}`, 0, "", func(t *testing.T, c *Config) {
			if c.AgentSocket != "/run/a.sock" || c.timeout != 1500*time.Millisecond || c.logLevel != slog.LevelDebug || c.LogFile != "/var/log/x.log" {
				t.Errorf("got socket %q timeout %v level %v file %q", c.AgentSocket, c.timeout, c.logLevel, c.LogFile)
			}
			if !c.excluded("istio-system") || c.excluded("default") {
				t.Errorf("excluded: %v", c.ExcludeNamespaces)
			}
			if c.PrevResult == nil {
				t.Error("prevResult not parsed")
			}
		}},
		{"not JSON", `{`, types.ErrDecodingFailure, "cannot decode network config", nil},
		{"wrong type", `{"cniVersion":"1.0.0","excludeNamespaces":"kube-system"}`, types.ErrDecodingFailure, "cannot decode", nil},
		{"zero timeout", `{"cniVersion":"1.0.0","timeout":"0s"}`, types.ErrInvalidNetworkConfig, "Go duration from 100ms to 2m0s", nil},
		{"negative timeout", `{"cniVersion":"1.0.0","timeout":"-1s"}`, types.ErrInvalidNetworkConfig, "Go duration from 100ms to 2m0s", nil},
		{"timeout past the kubelet's", `{"cniVersion":"1.0.0","timeout":"1h"}`, types.ErrInvalidNetworkConfig, "Go duration from 100ms to 2m0s", nil},
		{"unitless timeout", `{"cniVersion":"1.0.0","timeout":"30"}`, types.ErrInvalidNetworkConfig, "invalid timeout", nil},
		{"bad level", `{"cniVersion":"1.0.0","logLevel":"loud"}`, types.ErrInvalidNetworkConfig, "invalid logLevel", nil},
		{"relative socket", `{"cniVersion":"1.0.0","agentSocket":"run/a.sock"}`, types.ErrInvalidNetworkConfig, "absolute path", nil},
		{"bad prevResult", `{"cniVersion":"1.0.0","prevResult":{"ips":[{"address":"nope"}]}}`, types.ErrDecodingFailure, "cannot parse prevResult", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseConfig([]byte(tt.in))
			if tt.wantErrCode == 0 {
				if err != nil {
					t.Fatalf("parseConfig: %v", err)
				}
				tt.check(t, c)
				return
			}
			var e *types.Error
			if !errors.As(err, &e) || e.Code != tt.wantErrCode || !strings.Contains(e.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want CNI error %d containing %q", err, tt.wantErrCode, tt.wantErr)
			}
		})
	}
}

func TestPodIdentity(t *testing.T) {
	tests := []struct {
		name     string
		args     string
		wantOK   bool
		wantErr  string
		wantPod  string // fmt of name/ns/uid/infra
		fallback string
	}{
		{"no args", "", false, "", "", "ctr"},
		{"no k8s keys", "IgnoreUnknown=1;FOO=bar", false, "", "", "ctr"},
		{"unknown keys without IgnoreUnknown are fine", "FOO=bar;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", true, "", "p/ns//ctr", "ctr"},
		{"full", "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_INFRA_CONTAINER_ID=inf;K8S_POD_UID=u", true, "", "p/ns/u/inf", "ctr"},
		{"name only", "K8S_POD_NAME=p", false, "incomplete pod identity", "", "ctr"},
		{"uid only", "K8S_POD_UID=u", false, "incomplete pod identity", "", "ctr"},
		{"malformed pair", "K8S_POD_NAME", false, "cannot parse CNI_ARGS", "", "ctr"},
		{"empty pair", "K8S_POD_NAME=p;;K8S_POD_NAMESPACE=ns", false, "cannot parse CNI_ARGS", "", "ctr"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pod, ok, err := podIdentity(tt.args, tt.fallback)
			if tt.wantErr != "" {
				var e *types.Error
				if !errors.As(err, &e) || e.Code != types.ErrInvalidEnvironmentVariables || !strings.Contains(e.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want CNI error 4 containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || ok != tt.wantOK {
				t.Fatalf("ok=%v err=%v, want ok=%v", ok, err, tt.wantOK)
			}
			if ok {
				if got := fmt.Sprintf("%s/%s/%s/%s", pod.Name, pod.Namespace, pod.Uid, pod.InfraContainerId); got != tt.wantPod {
					t.Errorf("pod = %s, want %s", got, tt.wantPod)
				}
			}
		})
	}
}

func TestPodIPs(t *testing.T) {
	mustIP := func(s string) net.IPNet {
		n, err := types.ParseCIDR(s) // keeps the host part, unlike net.ParseCIDR
		if err != nil {
			t.Fatal(err)
		}
		return *n
	}
	idx := func(i int) *int { return &i }
	res := &current.Result{
		Interfaces: []*current.Interface{{Name: "cni0"}, {Name: "veth1"}, {Name: "eth0", Sandbox: "/var/run/netns/p"}},
		IPs: []*current.IPConfig{
			{Interface: idx(0), Address: mustIP("10.88.0.1/16")}, // the bridge's gateway address: host side
			{Interface: idx(2), Address: mustIP("10.88.0.7/16")},
			{Interface: idx(2), Address: mustIP("fd00::7/64")},
			{Address: mustIP("10.99.0.1/32")},                    // no interface: assume the pod's
			{Interface: idx(9), Address: mustIP("10.98.0.1/32")}, // dangling index: keep rather than drop
		},
	}
	got := podIPs(res)
	want := []string{"10.88.0.7/16", "fd00::7/64", "10.99.0.1/32", "10.98.0.1/32"}
	if !slices.Equal(got, want) {
		t.Errorf("podIPs = %v, want %v", got, want)
	}
}

func TestAgentError(t *testing.T) {
	pod := &cniapi.Pod{Name: "p", Namespace: "ns"}
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	live := context.Background()
	tests := []struct {
		name     string
		ctx      context.Context
		err      error
		wantCode uint
		wantMsg  string
	}{
		{"unavailable", live, status.Error(codes.Unavailable, "connect: no such file"), types.ErrTryAgainLater, "agent unreachable at /s (pod ns/p); connect: no such file"},
		{"deadline from gRPC", live, status.Error(codes.DeadlineExceeded, "context deadline exceeded"), types.ErrTryAgainLater, "timed out after 2s"},
		{"deadline from ctx", expired, status.Error(codes.Canceled, "x"), types.ErrTryAgainLater, "timed out after 2s"},
		{"permission", live, status.Error(codes.PermissionDenied, "peer uid 7 is not root"), ErrAgentRefused, "refused the connection (pod ns/p); peer uid 7"},
		{"refused", live, status.Error(codes.FailedPrecondition, "no rules"), ErrAgentRefused, "refused pod ns/p; FailedPrecondition: no rules"},
		{"plain error", live, errors.New("weird"), ErrAgentRefused, "Unknown: weird"},
		{"CNI error passes", live, types.NewError(7, "bad socket", ""), 7, "bad socket"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := agentError(tt.ctx, tt.err, "/s", 2*time.Second, pod)
			if e.Code != tt.wantCode || !strings.Contains(e.Error(), tt.wantMsg) {
				t.Errorf("got %d %q, want %d containing %q", e.Code, e.Error(), tt.wantCode, tt.wantMsg)
			}
		})
	}
}
