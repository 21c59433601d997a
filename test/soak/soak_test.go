//go:build e2e

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

var testEnv *e2eenv.Env

func TestMain(m *testing.M) {
	e2eenv.Main(m, e2eenv.Options{NodeName: "soak-node", AmbientPlugin: true}, func(e *e2eenv.Env) { testEnv = e })
}

// soakFor runs the soak with c on the package's environment and logs its
// summary; the summary and the timeline data go to SOAK_OUT/<test> when
// set (make soak-check draws them).
func soakFor(t *testing.T, c config) *result {
	t.Helper()
	ctx := testutil.Context(t, c.duration+5*time.Minute)
	res, err := run(ctx, testEnv, c, testLog{t})
	if err != nil {
		t.Fatalf("soak: %v", err)
	}
	t.Log(res.summary())
	t.Log(res.lastLine())
	out := t.TempDir()
	if d := os.Getenv("SOAK_OUT"); d != "" {
		out = d + "/" + t.Name()
	}
	if err := res.write(out); err != nil {
		t.Fatal(err)
	}
	return res
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestSoak is the 60-second soak of make check: every churn operation and
// every fault kind, seed 2, the agent on its default rules backend and its
// drift pass at the soak's period; any violation (bypass, black hole while
// served, restored unverified, ready while unserved, mesh pod added without
// an agent, plain pod refused while the API was up, conflist not followed,
// sidecar pod in ambient, lost pod, leak) fails it. Seed 2's
// first storm runs every process fault: an agent-term and an agent-kill
// with a resident pod's rules wiped while the agent is down (an agent
// built with ambientd_trust_restored fails it, docs/soak.md), and a
// ztunnel outage longer than the grace + 2 s.
func TestSoak(t *testing.T) {
	// SOAK_AGENT_ARGS adds agent flags (a later flag wins) and
	// SOAK_AGENT_BIN runs another agent binary, to run the same soak
	// against another agent (docs/soak.md, "Proving the soak fails").
	// SOAK_PLUGIN_BIN runs another CNI plugin, SOAK_RULES=nft the agent on
	// iptables-nft instead of its default backend.
	c := config{duration: 60 * time.Second, pods: 16, seed: 2, faults: allFaultKinds(), verifyInterval: 5 * time.Second,
		agentArgs: strings.Fields(os.Getenv("SOAK_AGENT_ARGS")), agentBin: os.Getenv("SOAK_AGENT_BIN"),
		pluginBin: os.Getenv("SOAK_PLUGIN_BIN"), rules: e2eenv.EnvString("SOAK_RULES", "auto")}
	res := soakFor(t, c)
	if res.rec.samples.Load() == 0 || res.faultCount() == 0 || res.created == 0 {
		t.Fatalf("the soak did nothing: %s", res.lastLine())
	}
	if n := res.violationCount(); n > 0 {
		t.Fatalf("%d violations (summary above): %s", n, res.lastLine())
	}
}

// TestSoakCatchesBypass proves the sampler's judgement against a known-bad
// agent: with the drift pass off (--verify-interval=0), rules wiped in
// enrolled pods are never repaired while the pods still claim to be
// enrolled — the sampler must report them as bypasses (and, once the faults
// stop, as lost pods).
func TestSoakCatchesBypass(t *testing.T) {
	c := config{duration: 25 * time.Second, pods: 10, seed: 4, faults: []string{"pod-rules-wiped"}, verifyInterval: 0}
	res := soakFor(t, c)
	kinds := map[string]int{}
	for _, v := range res.violations {
		kinds[v.Kind]++
	}
	if kinds[kindBypass] == 0 {
		t.Fatalf("rules wiped with the drift pass off: no bypass reported (violations by kind %v): the sampler misses what it is for", kinds)
	}
	t.Logf("caught: violations by kind %v", kinds)
}

// TestSoakCatchesBrokenPromises proves three of the sampler's judgements
// against known-bad parts: an agent with --ztunnel-grace=0 (never marks its
// pods not ready while no ztunnel serves) and --dns-capture=false (its
// pods' DNS goes out directly), and a plugin built with
// ambientd_absent_admit (lets every pod start while no agent answers).
// Only agent-kill and ztunnel-kill faults, seed 3: its storm has outages
// longer than the grace + 2 s, and agent downs in which pods in the mesh
// are made. Each kind must be reported.
func TestSoakCatchesBrokenPromises(t *testing.T) {
	bin := knownBadPlugin(t, "ambientd_absent_admit")
	c := config{duration: 30 * time.Second, pods: 10, seed: 3, faults: []string{"agent-kill", "ztunnel-kill"}, verifyInterval: 5 * time.Second,
		agentArgs: []string{"--ztunnel-grace=0", "--dns-capture=false"}, pluginBin: bin}
	res := soakFor(t, c)
	kinds := map[string]int{}
	for _, v := range res.violations {
		kinds[v.Kind]++
	}
	if kinds[kindUnservedReady] == 0 {
		t.Errorf("agent with --ztunnel-grace=0 through ztunnel outages: no %q reported (violations by kind %v)", kindUnservedReady, kinds)
	}
	if kinds[kindDNSBypass] == 0 {
		t.Errorf("agent with --dns-capture=false: no %q reported (violations by kind %v)", kindDNSBypass, kinds)
	}
	if kinds[kindAbsentAdd] == 0 {
		t.Errorf("plugin built with ambientd_absent_admit through agent kills: no %q reported (violations by kind %v)", kindAbsentAdd, kinds)
	}
	t.Logf("caught: violations by kind %v", kinds)
}

// knownBadPlugin builds bin/ambientd-cni with tag (a known-bad build,
// docs/soak.md) for the agent to install.
func knownBadPlugin(t *testing.T, tag string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "ambientd-cni-"+tag)
	build := exec.Command("go", "build", "-tags", "grpcnotrace,"+tag, "-o", bin, "./cmd/ambientd-cni")
	build.Dir = testEnv.Root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the known-bad plugin: %v\n%s", err, out)
	}
	return bin
}

// TestSoakCatchesPlainRefused proves the judgement of the plugin while no
// agent answers, the other way: a plugin built with ambientd_absent_refuse
// refuses every pod then, pods outside the mesh too, although the API
// could tell it they need no agent. The run of TestSoakAgentAway: pods
// outside the mesh are made and their sandboxes recreated while the agent
// is down; the sampler must report "plain pod refused while the API was
// up".
func TestSoakCatchesPlainRefused(t *testing.T) {
	c := agentAwayConfig()
	c.pluginBin, c.nsSuffix = knownBadPlugin(t, "ambientd_absent_refuse"), "r"
	res := soakFor(t, c)
	kinds := map[string]int{}
	for _, v := range res.violations {
		kinds[v.Kind]++
	}
	if kinds[kindPlainRefused] == 0 {
		t.Fatalf("plugin built with ambientd_absent_refuse through agent kills: no %q reported (violations by kind %v)", kindPlainRefused, kinds)
	}
	t.Logf("caught: violations by kind %v", kinds)
}

// agentAwayConfig is 15 s of agent-kill faults only, seed 5: its first
// kill keeps the agent down about 17 s, far past the install lease's TTL
// (2 s), while pods churn.
func agentAwayConfig() config {
	return config{duration: 15 * time.Second, pods: 10, seed: 5, faults: []string{"agent-kill"}, verifyInterval: 5 * time.Second}
}

// TestSoakAgentAway: the shipped plugin through agent outages longer than
// the install lease's TTL (the run TestSoakCatchesPlainRefused makes with
// a known-bad plugin). While no agent runs, pods outside the mesh start,
// with the lease past its TTL too, and mesh pods wait: no violation, and
// the run must have made both kinds of ADD while the agent was gone.
func TestSoakAgentAway(t *testing.T) {
	res := soakFor(t, agentAwayConfig())
	if n := res.violationCount(); n > 0 {
		t.Errorf("%d violations (summary above): %s", n, res.lastLine())
	}
	if res.plainPastTTL == 0 || res.absentAdds[1][0] == 0 {
		t.Errorf("the run made no ADD of a pod outside the mesh past the lease's TTL (%d) or no mesh pod's (%d waited) while the agent was gone: it proves nothing", res.plainPastTTL, res.absentAdds[1][0])
	}
	t.Logf("while no agent ran: outside the mesh %d started (%d past the TTL), in the mesh %d waited", res.absentAdds[0][1], res.plainPastTTL, res.absentAdds[1][0])
}
