// Command demo shows ambient enrollment end to end on one machine: a real
// kube-apiserver and etcd, the agent (bin/ambientd), the ztunnel emulator and
// a handful of pods created through the real CNI chain (bridge, host-local,
// bin/ambientd-cni), all inside a throwaway network namespace. It prints one
// row per pod — the redirection annotation, whether the emulator received an
// AddWorkload with the pod's netns, and who answered a connection into and
// out of the pod — then tears everything down. Run it with `make demo-lite` (`make demo` runs the real-node demo, test/demo).
//
// Exit status: 0 when every pod ended as the enrollment policy says it
// should; 1 otherwise. When bin/ambientd cannot run at all (not built yet),
// the demo shows the rest (control plane, chain, emulator) and exits 0.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

const (
	annotation = "ambient.istio.io/redirection"
	appPort    = 9080
)

type demoPod struct {
	ns, name string
	labels   map[string]string
	inMesh   bool   // what the enrollment policy says
	why      string // the policy reason, for the table
}

func main() {
	wait := flag.Duration("wait", 30*time.Second, "how long to wait for each pod's enrollment")
	verbose := flag.Bool("v", false, "print the agent's and the emulator's logs at the end")
	flag.Parse()
	os.Exit(e2eenv.Program(e2eenv.Options{NodeName: "demo-node", AmbientPlugin: true}, func(ctx context.Context, env *e2eenv.Env) int {
		return run(ctx, env, *wait, *verbose)
	}))
}

func run(ctx context.Context, env *e2eenv.Env, wait time.Duration, verbose bool) int {
	out := os.Stdout
	fmt.Fprintf(out, "control plane: kube-apiserver %s (etcd + apiserver ready in %s), node %q\n", env.CP.URL, env.CP.StartupTime.Round(time.Millisecond), env.NodeName)

	emu, err := env.StartEmulator(ctx, e2eenv.EmulatorConfig{NetnsMode: true})
	if err != nil {
		fmt.Fprintf(out, "ztunnel emulator: cannot start: %v\n", err)
		return 1
	}
	fmt.Fprintf(out, "ztunnel emulator: pid %d, connecting to %s\n", emu.Pid(), emu.Socket)

	agentUp := false
	agent, err := env.StartAgent(ctx, e2eenv.AgentConfig{Args: []string{"--log-level=debug"}})
	if err != nil {
		fmt.Fprintf(out, "agent: not available (%v)\n", err)
	} else {
		rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		err := agent.WaitReady(rctx)
		cancel()
		switch {
		case err == nil:
			agentUp = true
			fmt.Fprintf(out, "agent: pid %d ready (ztunnel connected, snapshot acked)\n", agent.Pid())
		case !agent.Running():
			fmt.Fprintf(out, "agent: exited, not available yet: %s\n", oneLine(agent.LogTail(3)))
		default:
			agentUp = true
			fmt.Fprintf(out, "agent: pid %d running but not ready after 60s: %v\n", agent.Pid(), oneLine(err.Error()))
		}
	}
	chain := env.Chain
	if !agentUp {
		chain = env.PlainChain
		fmt.Fprintln(out, "chain: bridge + host-local only (our plugin needs the agent)")
	} else {
		fmt.Fprintln(out, "chain: loopback, bridge + host-local, ambientd-cni")
	}

	for name, labels := range map[string]map[string]string{
		"shop":   {"istio.io/dataplane-mode": "ambient"},
		"legacy": nil,
	} {
		if _, err := env.CreateNamespace(ctx, name, labels); err != nil {
			fmt.Fprintf(out, "namespace %s: %v\n", name, err)
			return 1
		}
	}
	fmt.Fprintln(out, "namespaces: shop (istio.io/dataplane-mode=ambient), legacy (no label)")

	specs := []demoPod{
		{ns: "shop", name: "productpage", inMesh: true, why: "namespace ambient"},
		{ns: "shop", name: "reviews", inMesh: true, why: "namespace ambient"},
		{ns: "shop", name: "ratings", inMesh: true, why: "namespace ambient"},
		{ns: "shop", name: "batch-job", labels: map[string]string{"istio.io/dataplane-mode": "none"}, inMesh: false, why: "pod opted out"},
		{ns: "legacy", name: "payments", labels: map[string]string{"istio.io/dataplane-mode": "ambient"}, inMesh: true, why: "pod label ambient"},
		{ns: "legacy", name: "client", inMesh: false, why: "not labelled"},
	}
	pods := make([]*e2eenv.Pod, len(specs))
	for i, s := range specs {
		labels := map[string]string{"app": s.name}
		for k, v := range s.labels {
			labels[k] = v
		}
		start := time.Now()
		p, err := env.CreatePod(ctx, e2eenv.PodSpec{Namespace: s.ns, Name: s.name, Labels: labels, Chain: chain})
		if err != nil {
			fmt.Fprintf(out, "pod %s/%s: %v\n", s.ns, s.name, err)
			return 1
		}
		pods[i] = p
		fmt.Fprintf(out, "pod %s/%s: sandbox up, CNI ADD gave %s in %s\n", s.ns, s.name, p.IP(), time.Since(start).Round(time.Millisecond))
	}

	// Every pod runs a tiny "app" on :9080 that names itself, so a reply
	// shows who answered: the app directly, or ztunnel after a redirect.
	var wg sync.WaitGroup
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			l.Close()
		}
		wg.Wait()
	}()
	for _, p := range pods {
		l, err := p.Listen("tcp4", fmt.Sprintf(":%d", appPort))
		if err != nil {
			fmt.Fprintf(out, "app in %s/%s: %v\n", p.Namespace, p.Name, err)
			return 1
		}
		listeners = append(listeners, l)
		wg.Add(1)
		go func() { defer wg.Done(); serveApp(l, p.Name) }()
	}

	// Wait for each in-mesh pod's annotation (bounded), then look.
	annotations := make([]string, len(pods))
	for i, p := range pods {
		want := "enabled"
		wctx, cancel := context.WithTimeout(ctx, wait)
		if !specs[i].inMesh || !agentUp {
			// Out of the mesh: give the agent a moment to (wrongly) act.
			cancel()
			wctx, cancel = context.WithTimeout(ctx, 500*time.Millisecond)
		}
		obj, _ := env.WaitForPodAnnotation(wctx, p.Namespace, p.Name, annotation, want)
		cancel()
		if obj != nil {
			annotations[i] = obj.Annotations[annotation]
		}
	}

	client := pods[len(pods)-1]
	var st ztunnelemu.State
	rows := make([][]string, len(pods))
	ok := true
	for i, p := range pods {
		in := probe(ctx, client, p.IP()) // client -> pod:9080 (inbound)
		outb := "-"
		if p != client {
			outb = probe(ctx, p, client.IP()) // pod -> client:9080 (outbound)
		}
		if err := emu.State(ctx, &st); err != nil {
			fmt.Fprintf(out, "emulator state: %v\n", err)
			return 1
		}
		add := addWorkload(st, p.UID)
		ann := annotations[i]
		if ann == "" {
			ann = "-"
		}
		rows[i] = []string{p.Namespace + "/" + p.Name, p.IP().String(), specs[i].why, ann, add, in, outb}
		if agentUp {
			enrolled := ann == "enabled" && add != "-" && strings.HasPrefix(in, "ztunnel")
			untouched := ann == "-" && add == "-" && strings.HasPrefix(in, "app")
			if (specs[i].inMesh && !enrolled) || (!specs[i].inMesh && !untouched) {
				ok = false
				rows[i][2] += "  <-- UNEXPECTED"
			}
		}
	}

	fmt.Fprintln(out)
	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POD\tIP\tPOLICY\tANNOTATION\tADDWORKLOAD (emulator)\tINBOUND client→pod:9080\tOUTBOUND pod→client:9080")
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	tw.Flush()
	fmt.Fprintf(out, "\nemulator: %d workloads, %d requests received, %d connections captured, %d protocol errors\n",
		len(st.Workloads), len(st.Requests), len(st.Accepted), len(st.ProtocolErrors))
	for _, pe := range st.ProtocolErrors {
		fmt.Fprintf(out, "  protocol error: %s\n", pe.Message)
		ok = false
	}

	// Teardown through the chain, as the kubelet would.
	for _, p := range pods {
		if err := env.DeletePod(ctx, p); err != nil {
			fmt.Fprintf(out, "delete %s/%s: %v\n", p.Namespace, p.Name, err)
			ok = false
		}
	}
	if verbose || (agentUp && !ok) {
		if agent != nil {
			fmt.Fprintf(out, "\n----- agent log (last 80 lines) -----\n%s\n", agent.LogTail(80))
		}
		fmt.Fprintf(out, "----- emulator log (last 40 lines) -----\n%s\n", emu.LogTail(40))
	}
	switch {
	case !agentUp:
		fmt.Fprintln(out, "\nRESULT: the agent is not available yet; control plane, CNI chain and emulator work. Build it with `make build`.")
		return 0
	case ok:
		fmt.Fprintln(out, "\nRESULT: every pod is enrolled exactly as the policy says.")
		return 0
	default:
		fmt.Fprintln(out, "\nRESULT: FAIL: some pods are not where the policy puts them (marked above).")
		return 1
	}
}

// serveApp answers each connection with "app <name>" and closes it.
func serveApp(l net.Listener, name string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		fmt.Fprintf(c, "app %s\n", name)
		c.Close()
	}
}

// probe connects from pod to dst:9080 and reports who answered: the app, or
// the emulator's ztunnel listener (it writes a line naming itself).
func probe(ctx context.Context, from *e2eenv.Pod, dst netip.Addr) string {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := from.Dial(dctx, "tcp4", netip.AddrPortFrom(dst, appPort).String())
	if err != nil {
		return "error: " + shortErr(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(io.LimitReader(c, 512)).ReadString('\n')
	line = strings.TrimSpace(line)
	if line == "" {
		if err != nil {
			return "no answer: " + shortErr(err)
		}
		return "empty answer"
	}
	if strings.HasPrefix(line, "app ") {
		return line + " (direct)"
	}
	// "ztunnel-emulator uid=... listener=15006 orig_dst=10.88.0.5:9080"
	kv := map[string]string{}
	for _, f := range strings.Fields(line) {
		if k, v, ok := strings.Cut(f, "="); ok {
			kv[k] = v
		}
	}
	if kv["listener"] != "" {
		return fmt.Sprintf("ztunnel :%s (orig dst %s)", kv["listener"], kv["orig_dst"])
	}
	return "ztunnel? " + oneLine(line)
}

func addWorkload(st ztunnelemu.State, uid string) string {
	for _, r := range st.Requests {
		if r.Op == "add" && r.UID == uid {
			if r.AckError != "" {
				return "nacked: " + r.AckError
			}
			if r.FDs == 1 {
				return fmt.Sprintf("yes (netns inode %d)", r.NetnsInode)
			}
			return fmt.Sprintf("yes (%d fds!)", r.FDs)
		}
	}
	return "-"
}

func shortErr(err error) string {
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 && len(s)-i < 60 {
		return s[i+2:]
	}
	return oneLine(s)
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 160 {
		s = s[:160] + "..."
	}
	return s
}
