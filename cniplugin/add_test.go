package cniplugin

import (
	"bytes"
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"google.golang.org/grpc"

	"github.com/ambientd/ambientd/cniapi"
)

// stubAgent answers AddPod with a fixed response; it is a bare gRPC server
// (no peer check), so these tests run without root.
type stubAgent struct {
	cniapi.UnimplementedCNIEventsServer
	resp *cniapi.AddPodResponse
	got  chan *cniapi.AddPodRequest
}

func (s *stubAgent) AddPod(_ context.Context, req *cniapi.AddPodRequest) (*cniapi.AddPodResponse, error) {
	s.got <- req
	return s.resp, nil
}

func serveStub(t *testing.T, s *stubAgent) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cni.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	cniapi.RegisterCNIEventsServer(gs, s)
	go gs.Serve(ln)
	t.Cleanup(gs.Stop)
	return sock
}

func TestAddInProcess(t *testing.T) {
	prev := `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/p"}],"ips":[{"interface":0,"address":"10.0.0.2/24"}]}`
	tests := []struct {
		name    string
		outcome cniapi.Outcome
		wantErr string
	}{
		{"enrolled", cniapi.Outcome_OUTCOME_ENROLLED, ""},
		{"not in mesh", cniapi.Outcome_OUTCOME_NOT_IN_MESH, ""},
		{"no outcome is not a pass", cniapi.Outcome_OUTCOME_UNSPECIFIED, "gave no outcome for pod ns/p"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stub := &stubAgent{resp: &cniapi.AddPodResponse{Outcome: tt.outcome, AgentNanos: int64(1234 * time.Microsecond)}, got: make(chan *cniapi.AddPodRequest, 1)}
			sock := serveStub(t, stub)
			var stdout, stderr bytes.Buffer
			before := time.Now()
			p := &Plugin{Stdout: &stdout, Stderr: &stderr, Started: before.Add(-5 * time.Millisecond)}
			err := p.Add(&skel.CmdArgs{
				ContainerID: "c1", Netns: "/var/run/netns/p", IfName: "eth0",
				Args:      "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u",
				StdinData: []byte(`{"cniVersion":"1.0.0","name":"n","type":"ambientd-cni","agentSocket":"` + sock + `","prevResult":` + prev + `}`),
			})
			req := <-stub.got
			pod := req.GetPod()
			// The plugin's steps travel with the call: init since Started,
			// the call's start on the wall clock.
			tm := req.GetTimings()
			if init := time.Duration(tm.GetInitNanos()); init < 5*time.Millisecond || init > time.Minute {
				t.Errorf("reported init %v, want at least the 5ms since Started", init)
			}
			if cs := time.Unix(0, tm.GetCallStartUnixNano()); cs.Before(before.Truncate(0)) || cs.After(time.Now()) || tm.GetConfigNanos() <= 0 {
				t.Errorf("reported call start %v (config %v), want between the Add's start %v and its end", cs, time.Duration(tm.GetConfigNanos()), before)
			}
			if pod.GetName() != "p" || pod.GetNetnsPath() != "/var/run/netns/p" || strings.Join(pod.GetIps(), ",") != "10.0.0.2/24" || pod.GetInfraContainerId() != "c1" {
				t.Errorf("agent got %+v", pod)
			}
			if tt.wantErr != "" {
				var e *types.Error
				if !errors.As(err, &e) || e.Code != ErrAgentRefused || !strings.Contains(e.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want code %d containing %q", err, ErrAgentRefused, tt.wantErr)
				}
				if stdout.Len() != 0 {
					t.Errorf("printed a result on failure: %s", stdout.String())
				}
				return
			}
			if err != nil {
				t.Fatalf("Add: %v", err)
			}
			if !strings.Contains(stdout.String(), `"10.0.0.2/24"`) {
				t.Errorf("stdout %q is not prevResult", stdout.String())
			}
			if l := stderr.String(); !strings.Contains(l, "agent answered") || !strings.Contains(l, " agent=1.234ms ") || !strings.Contains(l, " total=") {
				t.Errorf("no log of the ADD's breakdown on stderr: %q", l)
			}
		})
	}
}
