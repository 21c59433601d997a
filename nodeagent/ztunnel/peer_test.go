package ztunnel

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	infra "github.com/ambientd/ambientd/test/infra/testutil"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// helperEnv makes the test binary act as a ztunnel (see TestMain), so a
// test can connect to the server from a process with another uid.
const helperEnv = "ZTUNNEL_TEST_HELPER_SOCKET"

func TestMain(m *testing.M) {
	if sock := os.Getenv(helperEnv); sock != "" {
		os.Exit(helperZtunnel(sock))
	}
	os.Exit(m.Run())
}

// helperZtunnel connects as ztunnel does (hello, then ack every request)
// and prints how many requests and descriptors it received before the
// snapshot ended or the agent closed the connection.
func helperZtunnel(sock string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := zp.Dial(ctx, sock)
	if err != nil {
		fmt.Printf("requests=0 fds=0 end=dial: %v\n", err)
		return 0
	}
	defer c.Close()
	requests, fds := 0, 0
	end := "snapshot sent"
	if err := c.Send(zp.HelloV1(), nil, time.Now().Add(5*time.Second)); err != nil {
		end = "hello: " + err.Error()
	} else {
		for {
			req, files, err := c.ReadRequest(time.Now().Add(5 * time.Second))
			if err != nil {
				end = err.Error()
				break
			}
			requests++
			fds += len(files)
			for _, f := range files {
				f.Close()
			}
			if zp.RequestOp(req) == zp.OpSnapshotSent {
				break
			}
			if err := c.Send(zp.AckResponse(""), nil, time.Now().Add(5*time.Second)); err != nil {
				end = "ack: " + err.Error()
				break
			}
		}
	}
	fmt.Printf("requests=%d fds=%d end=%s\n", requests, fds, end)
	return 0
}

// The attack: a non-root process that reaches the ztunnel socket (here by
// CAP_DAC_OVERRIDE past its 0600 mode) would receive every pod's network
// namespace. The server reads the peer's uid (SO_PEERCRED) at accept and
// closes the connection of one not allowed before sending anything: no
// request, no descriptor; the refusal is counted. The same process with its
// uid allowed (--ztunnel-allowed-uids) gets the snapshot with the fd, which
// shows the refusal is the check's doing.
func TestRefusesPeerWithDisallowedUID(t *testing.T) {
	infra.RequireRoot(t)
	const nobody, capDacOverride = 65534, 1
	n := newNetns(t)
	src := &source{}
	src.set(SnapshotEntry{Workload: wl("u1"), Netns: n.File})
	run := func(allowed []uint32, caps []uintptr) string {
		t.Helper()
		s, _ := runServer(t, Config{AllowedUIDs: allowed}, src)
		out := infra.RunTestBinaryAs(t, nobody, nobody, caps, []string{helperEnv + "=" + s.cfg.SocketPath})
		t.Logf("uid %d (caps %v), allowed uids %v: %s", nobody, caps, s.cfg.AllowedUIDs, strings.TrimSpace(out))
		return out
	}

	// The mode alone keeps an unprivileged process out.
	if out := run(nil, nil); !strings.Contains(out, "requests=0 fds=0") || !strings.Contains(out, "permission denied") {
		t.Errorf("unprivileged non-root peer: %q, want refused connect", out)
	}
	// Past the mode: the peer check.
	s, _ := runServer(t, Config{}, src)
	out := infra.RunTestBinaryAs(t, nobody, nobody, []uintptr{capDacOverride}, []string{helperEnv + "=" + s.cfg.SocketPath})
	if !strings.Contains(out, "requests=0 fds=0") {
		t.Errorf("non-root peer with CAP_DAC_OVERRIDE got something from the agent: %q", out)
	}
	var d dto.Metric
	if err := s.metrics.refused.Write(&d); err != nil || d.GetCounter().GetValue() != 1 {
		t.Errorf("ambientd_ztunnel_peers_refused_total = %v (%v), want 1", d.GetCounter().GetValue(), err)
	}
	if st := s.Status(); st.Connections != 0 {
		t.Errorf("refused peer registered as a ztunnel: %+v", st)
	}
	// Allowed: the same process is served the pod's netns.
	if out := run([]uint32{0, nobody}, []uintptr{capDacOverride}); !strings.Contains(out, "requests=2 fds=1 end=snapshot sent") {
		t.Errorf("allowed uid %d: %q, want the snapshot (an Add with its fd, SnapshotSent)", nobody, out)
	}
}
