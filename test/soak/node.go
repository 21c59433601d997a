package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// node is the node's processes the faults act on: the agent and the ztunnel
// emulators (newest last; more than one during a handover).
type node struct {
	env *e2eenv.Env
	cfg config
	log io.Writer

	mu     sync.Mutex
	agent  *e2eenv.Agent
	emus   []*e2eenv.Emulator
	emuSeq int
}

// startNode starts a ztunnel emulator and the agent, with install (the
// install flags: hostTree.agentArgs) before the soak's agent args.
func startNode(ctx context.Context, env *e2eenv.Env, c config, install []string, log io.Writer) (*node, error) {
	n := &node{env: env, cfg: c, log: log}
	if _, err := n.startEmulator(ctx); err != nil {
		return nil, err
	}
	// The environment pins iptables-nft for its own tests; the soak runs
	// the backend users get unless told otherwise.
	args := append(append([]string{"--verify-interval=" + c.verifyInterval.String(), "--iptables=" + c.rulesOr()}, install...), c.agentArgs...)
	if c.agentBin != "" {
		// The agent's process keeps its binary across the restarts of
		// the faults; the environment's default is back for the next run.
		defer func(bin string) { env.Bins.Agent = bin }(env.Bins.Agent)
		env.Bins.Agent = c.agentBin
	}
	a, err := env.StartAgent(ctx, e2eenv.AgentConfig{Args: args})
	if err != nil {
		return nil, err
	}
	n.agent = a
	if err := n.waitAgentReady(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// startEmulator starts one more ztunnel emulator (netns mode), the newest.
func (n *node) startEmulator(ctx context.Context) (*e2eenv.Emulator, error) {
	n.mu.Lock()
	n.emuSeq++
	name := fmt.Sprintf("ztunnel-%d", n.emuSeq)
	n.mu.Unlock()
	// A short record list: the sampler reads /state twice a round.
	em, err := n.env.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true, Name: name, Args: []string{"--max-records=50"}})
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	n.emus = append(n.emus, em)
	n.mu.Unlock()
	return em, nil
}

func (n *node) emulators() []*e2eenv.Emulator {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]*e2eenv.Emulator(nil), n.emus...)
}

// dropEmulator forgets a stopped emulator.
func (n *node) dropEmulator(em *e2eenv.Emulator) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for i, e := range n.emus {
		if e == em {
			n.emus = append(n.emus[:i], n.emus[i+1:]...)
			return
		}
	}
}

func (n *node) waitAgentReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	if err := n.agent.WaitReady(ctx); err != nil {
		return fmt.Errorf("agent not ready: %w\n%s", err, n.agent.LogTail(30))
	}
	return nil
}

// emuServing reports whether em is connected to the agent and its
// connection's snapshot is complete: the emulator's own view.
func emuServing(ctx context.Context, em *e2eenv.Emulator) (ztunnelemu.State, bool) {
	var st ztunnelemu.State
	if !em.Running() {
		return st, false
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := em.State(ctx, &st); err != nil || !st.Connected {
		return st, false
	}
	c, ok := st.Conn(st.CurrentConn)
	return st, ok && c.SnapshotSent && !c.Closed
}

// served: a ztunnel is connected and has its snapshot (any emulator).
func (n *node) served(ctx context.Context) bool {
	ok, _ := n.view(ctx)
	return ok
}

// view is the emulators' own view: whether one serves (connected, its
// snapshot complete), and the uids of the workloads any of them holds.
func (n *node) view(ctx context.Context) (bool, map[string]bool) {
	served, held := false, map[string]bool{}
	for _, em := range n.emulators() {
		st, ok := emuServing(ctx, em)
		served = served || ok
		for _, w := range st.Workloads {
			held[w.UID] = true
		}
	}
	return served, held
}

// waitServed waits until some emulator serves.
func (n *node) waitServed(ctx context.Context, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	for !n.served(ctx) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("no ztunnel connected with its snapshot within %v", within)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// restore brings the node back to one agent and one emulator, both up and
// serving (after the faults stopped).
func (n *node) restore(ctx context.Context) error {
	if !n.agent.Running() {
		if err := n.agent.Start(); err != nil {
			return err
		}
	}
	if len(n.emulators()) == 0 {
		if _, err := n.startEmulator(ctx); err != nil {
			return err
		}
	}
	if err := n.waitAgentReady(ctx); err != nil {
		return err
	}
	return n.waitServed(ctx, 60*time.Second)
}

func (n *node) stop() {
	_ = n.agent.Stop(10 * time.Second)
	for _, em := range n.emulators() {
		_ = em.Stop(10 * time.Second)
	}
}

// usage is what the agent process holds.
type usage struct {
	goroutines float64
	fds, netns int
	hostRules  string
}

func (n *node) measure(ctx context.Context) usage {
	var u usage
	u.goroutines, _ = n.agent.Metric(ctx, "go_goroutines", "")
	u.fds, u.netns = agentFDs(n.agent.Pid())
	u.hostRules = hostRules()
	return u
}

// agentFDs counts the process's open descriptors and those that are network
// namespaces.
func agentFDs(pid int) (all, netns int) {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return -1, -1
	}
	for _, e := range ents {
		all++
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(l, "net:[") {
			netns++
		}
	}
	return all, netns
}

// probeSetEntries counts the members of the node's probe ipsets.
func probeSetEntries() (int, error) {
	total := 0
	for _, set := range []string{iptables.ProbeSetV4, iptables.ProbeSetV6} {
		out, err := exec.Command("ipset", "list", set).CombinedOutput()
		if err != nil {
			if strings.Contains(string(out), "does not exist") {
				continue
			}
			return 0, fmt.Errorf("ipset list %s: %w: %s", set, err, out)
		}
		_, members, _ := strings.Cut(string(out), "Members:\n")
		for _, l := range strings.Split(members, "\n") {
			if strings.TrimSpace(l) != "" {
				total++
			}
		}
	}
	return total, nil
}

func veths() int {
	out, _ := exec.Command("ip", "-o", "link", "show", "type", "veth").Output()
	return strings.Count(string(out), "\n")
}

// leakCheck is one end-of-run check against what is alive (nothing: every
// pod was deleted).
type leakCheck struct {
	name, got, want string
	ok              bool
}

// checkLeaks waits up to 30 s for the node to hold nothing of the deleted
// pods, then reports each check.
func (s *soak) checkLeaks(ctx context.Context, base usage) []leakCheck {
	n := s.node
	phases := []string{"unverified", "pending", "enabled", "releasing"}
	var checks []leakCheck
	deadline := time.Now().Add(30 * time.Second)
	for {
		checks = checks[:0]
		add := func(name string, ok bool, got, want string) {
			checks = append(checks, leakCheck{name: name, got: got, want: want, ok: ok})
		}
		held := 0.0
		for _, ph := range phases {
			v, _ := n.agent.Metric(ctx, "ambientd_pods", `phase="`+ph+`"`)
			held += v
		}
		add("pods in the agent's registry (ambientd_pods)", held == 0, fmt.Sprint(held), "0")
		u := n.measure(ctx)
		add("netns descriptors the agent holds", u.netns == 0, fmt.Sprint(u.netns), "0")
		add("agent open descriptors", u.fds >= 0 && u.fds <= base.fds+8, fmt.Sprint(u.fds), fmt.Sprintf("≤ %d (at start %d, +8)", base.fds+8, base.fds))
		add("agent goroutines", u.goroutines <= base.goroutines+15, fmt.Sprint(u.goroutines), fmt.Sprintf("≤ %.0f (at start %.0f, +15)", base.goroutines+15, base.goroutines))
		add("host rules (nat, ISTIO_*)", u.hostRules == base.hostRules, fmt.Sprintf("%d lines", strings.Count(u.hostRules, "\n")+1), fmt.Sprintf("as at start (%d lines)", strings.Count(base.hostRules, "\n")+1))
		wl := 0
		for _, em := range n.emulators() {
			st, _ := emuServing(ctx, em)
			wl += len(st.Workloads)
		}
		add("workloads the ztunnel emulators serve", wl == 0, fmt.Sprint(wl), "0")
		ps, err := probeSetEntries()
		add("probe ipset entries", err == nil && ps == 0, fmt.Sprint(ps, " ", errString(err)), "0")
		leases, err := s.env.Chain.Leases()
		add("host-local leases", err == nil && len(leases) == 0, fmt.Sprint(len(leases), " ", errString(err)), "0")
		v := veths()
		add("veths on the node", v == 0, fmt.Sprint(v), "0")
		allOK := true
		for _, c := range checks {
			allOK = allOK && c.ok
		}
		if allOK || time.Now().After(deadline) || ctx.Err() != nil {
			return checks
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
