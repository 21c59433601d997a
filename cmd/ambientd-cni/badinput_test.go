package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambientd/ambientd/cniplugin"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

const podArgs = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=infra-1;K8S_POD_UID=uid-1"

// prevResult is what an interface-creating plugin would have returned.
func prevResult(netnsPath string) string {
	return fmt.Sprintf(`{"cniVersion":"1.1.0","interfaces":[{"name":"eth0","mac":"0a:58:0a:01:02:03","sandbox":%q}],`+
		`"ips":[{"interface":0,"address":"10.1.2.3/24","gateway":"10.1.2.1"}]}`, netnsPath)
}

func netconf(cniVersion, extra, prev string) []byte {
	s := fmt.Sprintf(`{"cniVersion":%q,"name":"ambient-test","type":"ambientd-cni"%s`, cniVersion, extra)
	if prev != "" {
		s += `,"prevResult":` + prev
	}
	return []byte(s + "}")
}

func cniEnv(cmd, netnsPath, args string) map[string]string {
	env := map[string]string{"CNI_COMMAND": cmd, "CNI_CONTAINERID": "infra-1", "CNI_NETNS": netnsPath, "CNI_IFNAME": "eth0"}
	if args != "" {
		env["CNI_ARGS"] = args
	}
	return env
}

// TestBadInput: every way an ADD can go wrong ends in a CNI error result that
// says what failed, a non-zero exit, in bounded time, and leaves nothing
// behind in the agent.
func TestBadInput(t *testing.T) {
	podNS := newNS(t)
	prev := prevResult(podNS.Path())

	refusing := &fakeAgent{addErr: errors.New("apply in-pod rules: iptables-restore: exit status 4")}
	refusingSock := startAgent(t, refusing)
	silent := &fakeAgent{block: true}
	silentSock := startAgent(t, silent)

	// A socket file nobody listens on: an agent that died.
	deadSock := filepath.Join(t.TempDir(), "dead.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: deadSock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()

	sockOpt := func(sock string) string { return fmt.Sprintf(`,"agentSocket":%q`, sock) }
	tests := []struct {
		name     string
		env      map[string]string
		stdin    []byte
		wantCode uint
		wantMsg  []string // all must appear in msg+details
		minTook  time.Duration
		after    func(t *testing.T)
	}{
		{"malformed stdin JSON", cniEnv("ADD", podNS.Path(), podArgs), []byte(`{"cniVersion":"1.1.0","name":`),
			types.ErrDecodingFailure, []string{"network config", "unexpected end of JSON input"}, 0, nil},
		{"config not an object", cniEnv("ADD", podNS.Path(), podArgs), []byte(`{"cniVersion":"1.1.0","name":"x","timeout":7}`),
			types.ErrDecodingFailure, []string{"cannot decode network config"}, 0, nil},
		{"unsupported cniVersion (too old to chain)", cniEnv("ADD", podNS.Path(), podArgs), netconf("0.2.0", "", prev),
			types.ErrIncompatibleCNIVersion, []string{"incompatible CNI versions"}, 0, nil},
		{"unsupported cniVersion (future)", cniEnv("ADD", podNS.Path(), podArgs), netconf("9.9.9", "", prev),
			types.ErrIncompatibleCNIVersion, []string{"incompatible CNI versions"}, 0, nil},
		{"missing prevResult", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", sockOpt(refusingSock), ""),
			types.ErrInvalidNetworkConfig, []string{"missing prevResult", "run last"}, 0, nil},
		{"malformed prevResult", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", "", `{"ips":"nope"}`),
			types.ErrDecodingFailure, []string{"cannot parse prevResult"}, 0, nil},
		{"bad timeout", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", `,"timeout":"soon"`, prev),
			types.ErrInvalidNetworkConfig, []string{"invalid timeout", `"soon"`}, 0, nil},
		{"relative agentSocket", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", `,"agentSocket":"cni.sock"`, prev),
			types.ErrInvalidNetworkConfig, []string{"absolute path"}, 0, nil},
		{"CNI_ARGS with a name but no namespace", cniEnv("ADD", podNS.Path(), "K8S_POD_NAME=web-0"), netconf("1.1.0", sockOpt(refusingSock), prev),
			types.ErrInvalidEnvironmentVariables, []string{"incomplete pod identity", "K8S_POD_NAMESPACE"}, 0, nil},
		{"CNI_ARGS malformed", cniEnv("ADD", podNS.Path(), "K8S_POD_NAME"), netconf("1.1.0", sockOpt(refusingSock), prev),
			types.ErrInvalidEnvironmentVariables, []string{"cannot parse CNI_ARGS", "invalid pair"}, 0, nil},
		{"missing CNI_NETNS", cniEnv("ADD", "", podArgs), netconf("1.1.0", sockOpt(refusingSock), prev),
			types.ErrInvalidEnvironmentVariables, []string{"CNI_NETNS"}, 0, nil},
		{"agent socket does not exist", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", sockOpt("/nonexistent/ambientd/cni.sock"), prev),
			types.ErrTryAgainLater, []string{"agent unreachable at /nonexistent/ambientd/cni.sock", "shop/web-0", "no such file"}, 0, nil},
		{"agent socket refuses connections", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", sockOpt(deadSock), prev),
			types.ErrTryAgainLater, []string{"agent unreachable", "connection refused"}, 0, nil},
		{"agent never answers", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", sockOpt(silentSock)+`,"timeout":"1s"`, prev),
			types.ErrTryAgainLater, []string{"timed out after 1s waiting for the ambientd agent", "shop/web-0"}, time.Second,
			func(t *testing.T) {
				// The agent saw the call; it is released when the plugin gives up (leak checks below).
				if adds, _ := silent.events(); len(adds) != 1 {
					t.Errorf("silent agent got %d adds, want 1", len(adds))
				}
			}},
		{"agent refuses", cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", sockOpt(refusingSock), prev),
			cniplugin.ErrAgentRefused, []string{"agent refused pod shop/web-0", "Internal", "iptables-restore: exit status 4"}, 0, nil},
		{"CHECK without prevResult", cniEnv("CHECK", podNS.Path(), podArgs), netconf("1.1.0", "", ""),
			types.ErrInvalidNetworkConfig, []string{"missing prevResult"}, 0, nil},
		{"unknown command", cniEnv("FROB", podNS.Path(), podArgs), netconf("1.1.0", "", prev),
			types.ErrInvalidEnvironmentVariables, []string{"unknown CNI_COMMAND"}, 0, nil},
	}

	// Baseline once the agents are up and have served a call each, so the
	// gRPC server's steady-state goroutines are counted.
	warm := execPlugin(t, cniEnv("ADD", podNS.Path(), podArgs), netconf("1.1.0", sockOpt(refusingSock), prev), nil)
	if warm.exit == 0 {
		t.Fatalf("warm-up against the refusing agent succeeded: %s", warm.stdout)
	}
	goroutines, fds := runtime.NumGoroutine(), testutil.CountFDs(t)

	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := execPlugin(t, tt.env, tt.stdin, nil)
			if r.exit == 0 {
				t.Fatalf("exit 0, want failure; stdout %s", r.stdout)
			}
			e := r.cniError(t)
			if e.Code != tt.wantCode {
				t.Errorf("code = %d, want %d (%s)", e.Code, tt.wantCode, e)
			}
			for _, m := range tt.wantMsg {
				if !strings.Contains(e.Error(), m) {
					t.Errorf("error %q does not say %q", e.Error(), m)
				}
			}
			if r.took < tt.minTook {
				t.Errorf("failed after %v, before the %v timeout: not the failure under test", r.took, tt.minTook)
			}
			t.Logf("code %d: %s (%v)", e.Code, e, r.took.Round(time.Millisecond))
			if tt.after != nil {
				tt.after(t)
			}
		})
	}

	testutil.Eventually(t, "agent goroutines back to baseline", waitTimeout, func() bool { return runtime.NumGoroutine() <= goroutines })
	testutil.Eventually(t, "agent fds back to baseline", waitTimeout, func() bool { return testutil.CountFDs(t) <= fds })
	for _, sock := range []string{refusingSock, silentSock} {
		ents, err := os.ReadDir(filepath.Dir(sock))
		if err != nil || len(ents) != 1 {
			t.Errorf("socket dir of %s holds %v (%v), want only the socket", sock, ents, err)
		}
	}
}

// TestPassThrough: calls the plugin must not take to the agent succeed with
// prevResult unchanged and never reach it; DEL, STATUS and GC succeed even
// with no agent at all.
func TestPassThrough(t *testing.T) {
	podNS := newNS(t)
	prev := prevResult(podNS.Path())
	ag := &fakeAgent{outcome: agent.Enrolled}
	sock := startAgent(t, ag)
	withAgent := fmt.Sprintf(`,"agentSocket":%q,"excludeNamespaces":["kube-system","shop-excluded"]`, sock)
	noAgent := `,"agentSocket":"/nonexistent/ambientd/cni.sock"`
	silentSock := startAgent(t, &fakeAgent{block: true})

	tests := []struct {
		name       string
		env        map[string]string
		stdin      []byte
		wantResult bool // stdout must equal prevResult
	}{
		{"ADD without CNI_ARGS (not a Kubernetes pod)", cniEnv("ADD", podNS.Path(), ""), netconf("1.1.0", withAgent, prev), true},
		{"ADD with CNI_ARGS but no K8S keys", cniEnv("ADD", podNS.Path(), "IgnoreUnknown=1;FOO=bar"), netconf("1.1.0", withAgent, prev), true},
		{"ADD in an excluded namespace", cniEnv("ADD", podNS.Path(), "K8S_POD_NAMESPACE=shop-excluded;K8S_POD_NAME=x"), netconf("1.1.0", withAgent, prev), true},
		{"DEL with no agent", cniEnv("DEL", podNS.Path(), podArgs), netconf("1.1.0", noAgent, prev), false},
		{"DEL with an agent that never answers", cniEnv("DEL", "", podArgs), netconf("1.1.0", fmt.Sprintf(`,"agentSocket":%q,"timeout":"1s"`, silentSock), ""), false},
		{"DEL with a broken config", cniEnv("DEL", podNS.Path(), podArgs), netconf("1.1.0", `,"timeout":"soon"`, ""), false},
		{"CHECK with no agent", cniEnv("CHECK", podNS.Path(), podArgs), netconf("1.1.0", noAgent, prev), false},
		{"STATUS with no agent", cniEnv("STATUS", "", ""), netconf("1.1.0", noAgent, ""), false},
		{"GC with no agent", cniEnv("GC", "", ""), netconf("1.1.0", noAgent+`,"cni.dev/valid-attachments":[]`, ""), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := execPlugin(t, tt.env, tt.stdin, nil)
			if r.exit != 0 {
				t.Fatalf("exit %d, want 0; stdout %s stderr %s", r.exit, r.stdout, r.stderr)
			}
			if tt.wantResult {
				if !sameJSON(t, r.stdout, []byte(prev)) {
					t.Errorf("stdout %s, want prevResult %s", r.stdout, prev)
				}
			} else if len(r.stdout) != 0 {
				t.Errorf("stdout %q, want nothing", r.stdout)
			}
		})
	}
	if adds, dels := ag.events(); len(adds) != 0 || len(dels) != 0 {
		t.Errorf("agent was called: adds %+v dels %+v", adds, dels)
	}
}

// TestVersion: the plugin speaks every chaining-capable spec version up to 1.1.0.
func TestVersion(t *testing.T) {
	r := execPlugin(t, map[string]string{"CNI_COMMAND": "VERSION"}, nil, nil)
	if r.exit != 0 {
		t.Fatalf("VERSION exit %d: %s", r.exit, r.stdout)
	}
	var v struct {
		SupportedVersions []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal(r.stdout, &v); err != nil {
		t.Fatalf("VERSION output %q: %v", r.stdout, err)
	}
	if strings.Join(v.SupportedVersions, ",") != "0.3.0,0.3.1,0.4.0,1.0.0,1.1.0" {
		t.Errorf("supportedVersions = %v", v.SupportedVersions)
	}
}

// TestNonRootPeerRefused: a plugin run by a non-root user that gets past the
// socket's 0600 mode (CAP_DAC_OVERRIDE) is still refused by SO_PEERCRED, and
// says so in its error result.
func TestNonRootPeerRefused(t *testing.T) {
	podNS := newNS(t)
	ag := &fakeAgent{outcome: agent.Enrolled}
	sock := startAgent(t, ag)
	// The socket's directory must be searchable for uid 65534 to reach the
	// socket at all.
	if err := os.Chmod(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Dir(filepath.Dir(sock)), 0o755); err != nil {
		t.Fatal(err)
	}
	const capDacOverride = 1
	attr := &syscall.SysProcAttr{
		Credential:  &syscall.Credential{Uid: 65534, Gid: 65534},
		AmbientCaps: []uintptr{capDacOverride},
	}
	stdin := netconf("1.1.0", fmt.Sprintf(`,"agentSocket":%q`, sock), prevResult(podNS.Path()))
	r := execPlugin(t, cniEnv("ADD", podNS.Path(), podArgs), stdin, attr)
	if r.exit == 0 {
		t.Fatalf("non-root ADD succeeded: %s", r.stdout)
	}
	e := r.cniError(t)
	if e.Code != cniplugin.ErrAgentRefused || !strings.Contains(e.Error(), "refused the connection") || !strings.Contains(e.Error(), "peer uid 65534") {
		t.Errorf("non-root ADD: code %d %q, want agent refusal naming uid 65534", e.Code, e)
	}
	if adds, _ := ag.events(); len(adds) != 0 {
		t.Errorf("agent handled %d adds from a non-root peer", len(adds))
	}
}
