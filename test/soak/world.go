package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/types"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
)

// Ports inside the pods: every soak pod serves appPort (answers "app
// <name>"); the prober pod serves remotePort (answers "remote"); a
// sidecar-mode pod's stand-in for its istio-proxy listens on Envoy's
// outbound and inbound capture ports (answers "sidecar <name>").
const (
	appPort             = 8080
	remotePort          = 7000
	nameserverPort      = 53
	nameserverAnswer    = "nameserver"
	envoyOutboundPort   = 15001
	envoyInboundPort    = 15006
	residentPods        = 2
	sidecarGoldenCase   = "redirect-default"
	sidecarAnswerPrefix = "sidecar "
)

// nsRec is one of the soak's namespaces.
type nsRec struct {
	name string
	// ambient is the namespace's label as last written (under soak.mu).
	ambient     bool
	stableSince time.Time // last label change (under soak.mu)
}

// podRec is one soak pod. mu is held for writing while the pod's sandbox
// changes or it is deleted, for reading while the sampler dials it.
type podRec struct {
	mu      sync.RWMutex
	id      int
	ns      *nsRec
	name    string
	p       *e2eenv.Pod
	uid     string
	lns     []net.Listener
	deleted bool

	// resident pods (made at setup, in the ambient namespace) are never
	// deleted, recreated or relabelled by the churn: the agent-restart
	// faults wipe their rules while the agent is down, and they live long
	// enough for a restarted agent that trusts them unverified to be seen.
	resident bool
	// sidecar: a pod as Istio's injector makes it (sidecar.istio.io/status,
	// istio-proxy, istio-validation), never in ambient whatever its labels.
	sidecar bool

	// Under soak.mu: the pod's own label ("", ambient, none) and the last
	// change of its sandbox or labels.
	podMode     string
	stableSince time.Time
	// sidecarRules (sidecar pods): the pod must be captured for its own
	// proxy — its current sandbox was made through our plugin with the
	// conflist intact, or it was seen captured so since (a restarted
	// agent captures every running sidecar pod it finds, whatever made its
	// sandbox; the sampler sets it then). Otherwise it may be plain.
	sidecarRules bool
	// downWipedAt: an agent-restart fault wiped the pod's rules while the
	// agent was down; downWipeStartAt: the soak started the agent again
	// (zero until then). A restarted agent verifies the pods it restores
	// before it takes a ztunnel's connection (judgeRestored).
	downWipedAt, downWipeStartAt time.Time

	// wiping is set while a pod-rules-wiped fault works on the pod: the
	// agent is judged on the bypass only from the end of the wipe (on a
	// loaded machine the iptables calls of one wipe can take seconds).
	wiping atomic.Bool

	judge judgeState // the sampler's alone
}

// soak is one run: the environment, the node's processes, the pods and what
// was recorded.
type soak struct {
	cfg   config
	env   *e2eenv.Env
	log   io.Writer
	start time.Time
	rng   *rand.Rand // the churn's; faults have their own
	frng  *rand.Rand

	node *node
	// host is the node's CNI tree the agent installs into (install.go);
	// primaryRev numbers the primary's rewrites.
	host       *hostTree
	primaryRev atomic.Int64

	mu       sync.Mutex
	pods     map[int]*podRec
	nextID   int
	nss      []*nsRec
	prober   *e2eenv.Pod
	proberIP string
	// proberDNS is the prober's UDP port 53: the pods' nameserver, which
	// answers nameserverAnswer to a query that reaches it directly.
	proberDNS string
	dnsConn   net.PacketConn

	// dnsAnswers counts the DNS probes by outcome.
	dnsAnswers [outSidecar + 1]atomic.Int64

	created, deleted atomic.Int64
	opsMu            sync.Mutex
	ops              map[string]*opCount

	rec *recorder

	// sidecarGolden is the injected pod the sidecar-mode pods copy.
	sidecarGolden istiogolden.Case
	// sidecars counts the sidecar-mode pods made; downWipes the resident
	// pods wiped while the agent was down, downWipesSeen those of them
	// sampled after the restarted agent was ready (judged).
	sidecars, downWipes, downWipesSeen atomic.Int64
	// absentAdds counts the judged ADDs through our plugin made wholly
	// while no agent ran (countAbsent), by [in the mesh][started].
	absentAdds [2][2]atomic.Int64
	// plainPastTTL: of those, pods outside the mesh that started with the
	// install lease past its TTL.
	plainPastTTL atomic.Int64
	slowLogged   time.Time // the sampler's alone

	claimMu    sync.Mutex
	lastClaims map[string]claim // by pod uid
	claimsAt   time.Time
}

type opCount struct{ ok, failed int }

func (s *soak) countOp(name string, err error) {
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	c := s.ops[name]
	if c == nil {
		c = &opCount{}
		s.ops[name] = c
	}
	if err != nil {
		c.failed++
		if c.failed <= 3 {
			s.logf("churn %s: %v", name, err)
		}
	} else {
		c.ok++
	}
}

func (s *soak) logf(format string, args ...any) {
	fmt.Fprintf(s.log, "soak %6.1fs: %s\n", time.Since(s.start).Seconds(), fmt.Sprintf(format, args...))
}

// run is the whole soak: set up, churn + faults + sampler for cfg.duration,
// settle, tear down, check for leaks.
func run(ctx context.Context, env *e2eenv.Env, c config, log io.Writer) (*result, error) {
	s := &soak{
		cfg: c, env: env, log: log, start: time.Now(),
		rng:  rand.New(rand.NewPCG(uint64(c.seed), 1)),
		frng: rand.New(rand.NewPCG(uint64(c.seed), 2)),
		pods: map[int]*podRec{}, ops: map[string]*opCount{},
	}
	s.rec = newRecorder(s.start)
	res := &result{cfg: c, machineStart: e2eenv.Machine(), rec: s.rec}
	var err error
	if s.sidecarGolden, err = istiogolden.LoadCase(sidecarGoldenCase); err != nil {
		return nil, fmt.Errorf("the sidecar-mode pods' injected spec: %w", err)
	}
	// The node as installed (install.go): the agent installs the plugin
	// (the known-bad build when one is given: docs/soak.md) into the
	// soak's host tree, and every pod's ADD runs what the runtime finds
	// there. The environment's chain is back for the next run.
	if s.host, err = newHostTree(env); err != nil {
		return nil, fmt.Errorf("the node's CNI tree: %w", err)
	}
	defer s.host.remove()
	defer func(chain *e2eenv.Chain) { env.Chain = chain }(env.Chain)
	env.Chain = s.host.runtime
	if err := createDaemonSet(ctx, env); err != nil {
		return nil, fmt.Errorf("the agent's DaemonSet: %w", err)
	}
	// After the agent stopped (deferred calls run last first): with the
	// DaemonSet gone first, its SIGTERM would uninstall.
	defer func() {
		if err := deleteDaemonSet(context.WithoutCancel(ctx), env); err != nil {
			s.logf("deleting the agent's DaemonSet: %v", err)
		}
	}()
	if c.pluginBin == "" {
		c.pluginBin = env.Bins.CNIPlugin
		s.cfg.pluginBin = c.pluginBin
	}
	if s.node, err = startNode(ctx, env, c, s.host.agentArgs(c.pluginBin, c.leaseTTLOr()), log); err != nil {
		return nil, err
	}
	if err := s.host.waitInstalled(ctx, 30*time.Second); err != nil {
		s.node.stop()
		return nil, err
	}
	res.baseline = s.node.measure(ctx)
	if err := s.setup(ctx); err != nil {
		// The next run on this environment must not meet this one's agent
		// and ztunnel.
		s.node.stop()
		return nil, err
	}
	s.logf("setup done: agent ready, prober at %s; churning %d pods for %v (seed %d), faults: %s", s.proberIP, c.pods, c.duration, c.seed, strings.Join(c.faults, ","))
	s.logf("agent --iptables=%s; bounds: bypass %v, restored unverified the later of %v from the restart action and %v from a ztunnel served, ready while unserved %v from the ztunnels' kill", c.rulesOr(), bypassBound(c), restoredBound, restoredSlack, unservedBound(c))

	runCtx, stopRun := context.WithTimeout(ctx, c.duration)
	defer stopRun()
	sampCtx, stopSampler := context.WithCancel(ctx)
	var sampler sync.WaitGroup
	sampler.Go(func() { s.sample(sampCtx) })
	var work sync.WaitGroup
	work.Go(func() { s.churn(runCtx) })
	work.Go(func() { s.injectFaults(runCtx) })
	work.Wait()
	s.logf("churn and faults stopped; settling")

	// Settle: every process back, then every pod must reach its policy
	// state within the lost-pod bound (the sampler judges it).
	if err := s.node.restore(ctx); err != nil {
		s.rec.violation(violation{At: time.Now(), Kind: kindStuck, Detail: err.Error()})
	} else if err := s.host.waitInstalled(ctx, 30*time.Second); err != nil {
		s.rec.violation(violation{At: time.Now(), Kind: kindStuck, Detail: err.Error()})
	}
	s.rec.faultEnded(time.Now())
	settleCtx, cancelSettle := context.WithTimeout(ctx, lostBound+10*time.Second)
	s.waitAllInPolicy(settleCtx)
	cancelSettle()
	stopSampler()
	sampler.Wait()
	res.settled = time.Now()

	s.logf("DNS probes of ambient-capable pods: %d answered by their ztunnel, %d by the nameserver directly, %d by nobody, %d by someone else",
		s.dnsAnswers[outProxy].Load(), s.dnsAnswers[outDirect].Load(), s.dnsAnswers[outDead].Load(), s.dnsAnswers[outForeign].Load())
	res.machineEnd = e2eenv.LoadAverage()
	s.teardownPods(ctx)
	res.leaks = s.checkLeaks(ctx, res.baseline)
	for _, l := range res.leaks {
		if !l.ok {
			s.rec.violation(violation{At: time.Now(), Kind: kindLeak, Detail: l.name + ": " + l.got})
		}
	}
	res.created, res.deleted = s.created.Load(), s.deleted.Load()
	res.sidecars, res.downWipes, res.downWipesSeen = s.sidecars.Load(), s.downWipes.Load(), s.downWipesSeen.Load()
	res.plainPastTTL = s.plainPastTTL.Load()
	for mesh := range 2 {
		for started := range 2 {
			res.absentAdds[mesh][started] = s.absentAdds[mesh][started].Load()
		}
	}
	res.ops = s.ops
	res.agentLog = s.node.agent.LogPath
	res.attachLogs()
	s.node.stop()
	return res, nil
}

// setup creates the namespaces and the prober: a pod outside the mesh
// (plain chain, plain namespace) that serves remotePort, the outbound
// probes' destination, and dials the pods' appPort, the inbound probes.
func (s *soak) setup(ctx context.Context) error {
	run := fmt.Sprintf("%d%s", s.cfg.seed, s.cfg.nsSuffix)
	for _, n := range []struct {
		suffix  string
		ambient bool
	}{{"ambient", true}, {"plain", false}, {"flip", true}} {
		ns := &nsRec{name: "soak-" + run + "-" + n.suffix, ambient: n.ambient, stableSince: time.Now()}
		if _, err := s.env.CreateNamespace(ctx, ns.name, nsLabels(n.ambient)); err != nil {
			return err
		}
		s.nss = append(s.nss, ns)
	}
	probeNS := "soak-" + run + "-prober"
	if _, err := s.env.CreateNamespace(ctx, probeNS, nil); err != nil {
		return err
	}
	p, err := s.env.CreatePod(ctx, e2eenv.PodSpec{Namespace: probeNS, Name: "prober", Chain: s.env.PlainChain})
	if err != nil {
		return err
	}
	s.prober = p
	s.proberIP = netIPPort(p.IP().String(), remotePort)
	ln, err := p.Listen("tcp", fmt.Sprintf(":%d", remotePort))
	if err != nil {
		return err
	}
	go serveLine(ln, "remote")
	if err := p.Do(func() error {
		var err error
		s.dnsConn, err = net.ListenPacket("udp4", fmt.Sprintf(":%d", nameserverPort))
		return err
	}); err != nil {
		return fmt.Errorf("the prober's nameserver: %w", err)
	}
	s.proberDNS = netIPPort(p.IP().String(), nameserverPort)
	go serveDatagrams(s.dnsConn, nameserverAnswer)
	for range residentPods {
		s.mu.Lock()
		s.nextID++
		id := s.nextID
		s.mu.Unlock()
		if err := s.createPod(ctx, id, s.nss[0], "", podKind{resident: true}); err != nil {
			return fmt.Errorf("resident pod: %w", err)
		}
	}
	return nil
}

// serveDatagrams answers every datagram on pc with one line, until pc is
// closed.
func serveDatagrams(pc net.PacketConn, line string) {
	buf := make([]byte, 512)
	for {
		_, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		_, _ = pc.WriteTo([]byte(line+"\n"), from)
	}
}

func nsLabels(ambient bool) map[string]string {
	if ambient {
		return map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
	}
	return nil
}

func netIPPort(ip string, port int) string { return net.JoinHostPort(ip, fmt.Sprint(port)) }

// serveLine answers every connection with one line, then closes it.
func serveLine(ln net.Listener, line string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_ = c.SetWriteDeadline(time.Now().Add(2 * time.Second))
		fmt.Fprintln(c, line)
		c.Close()
	}
}

// wantMesh is the enrollment policy for the pod as the soak set its labels
// (the soak's own record, not the agent's view): a sidecar pod never. Under
// s.mu.
func wantMesh(r *podRec) bool {
	if r.sidecar || r.podMode == podmeta.ModeNone {
		return false
	}
	return r.ns.ambient || r.podMode == podmeta.ModeAmbient
}

// policyState is the state the pod must be sampled in: meshed (in the
// mesh), captured by its own proxy (a sidecar pod made through our plugin)
// or plain. Under s.mu.
func policyState(r *podRec) state {
	switch {
	case r.sidecar && r.sidecarRules:
		return stSidecar
	case wantMesh(r):
		return stMeshed
	}
	return stPlain
}

// observeSidecar takes a sample of the pod: a sidecar pod seen captured for
// its own proxy is held to that from then on, whatever made its sandbox (a
// restarted agent captures every running sidecar pod it finds). Under s.mu.
func observeSidecar(r *podRec, st state) {
	if r.sidecar && st == stSidecar {
		r.sidecarRules = true
	}
}

// stable is when the pod last changed in a way that moves its policy state.
// Under s.mu.
func stable(r *podRec) time.Time {
	if r.ns.stableSince.After(r.stableSince) {
		return r.ns.stableSince
	}
	return r.stableSince
}

// alive returns the pods not being deleted, by id.
func (s *soak) alive() []*podRec {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*podRec, 0, len(s.pods))
	for _, r := range s.pods {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b *podRec) int { return a.id - b.id })
	return out
}

// churn runs pod operations at a steady rate until ctx ends, at most three
// at once, then waits for those in flight.
func (s *soak) churn(ctx context.Context) {
	sem := make(chan struct{}, 3)
	var wg sync.WaitGroup
	defer wg.Wait()
	for ctx.Err() == nil {
		op := s.pickOp()
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			octx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			op.run(octx)
		})
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(150+s.rng.IntN(300)) * time.Millisecond):
		}
	}
}

type churnOp struct {
	name string
	run  func(ctx context.Context)
}

// pickOp chooses the next operation: creates keep about cfg.pods alive,
// deletes keep them turning over, the rest change labels and sandboxes.
func (s *soak) pickOp() churnOp {
	s.mu.Lock()
	n := len(s.pods)
	s.mu.Unlock()
	r := s.rng.Float64()
	switch {
	case n < s.cfg.pods/2 || (n < s.cfg.pods && r < 0.45):
		return s.createOp()
	case r < 0.65:
		return s.withPod("delete", s.deletePod)
	case r < 0.77:
		return s.withPod("pod-label-flip", s.flipPodLabel)
	case r < 0.80:
		return churnOp{"ns-label-flip", s.flipNamespace}
	case r < 0.90:
		return s.withPod("sandbox-recreate", func(ctx context.Context, p *podRec) error { return s.recreate(ctx, p, false) })
	default:
		return s.withPod("sandbox-recreate-without-plugin", func(ctx context.Context, p *podRec) error { return s.recreate(ctx, p, true) })
	}
}

// withPod picks a random live pod now (in the churn's goroutine, so the
// plan follows the seed) and runs f on it later.
func (s *soak) withPod(name string, f func(context.Context, *podRec) error) churnOp {
	pods := slices.DeleteFunc(s.alive(), func(r *podRec) bool { return r.resident })
	if len(pods) == 0 {
		return s.createOp()
	}
	p := pods[s.rng.IntN(len(pods))]
	return churnOp{name, func(ctx context.Context) { s.countOp(name, f(ctx, p)) }}
}

// createOp makes a pod of a random kind: in the ambient namespace (some
// opted out with dataplane-mode=none), in the plain namespace (some opted
// in with dataplane-mode=ambient), in the namespace whose label flips, or a
// sidecar-mode pod (in the ambient or the flip namespace: its labels must
// never put it in ambient).
func (s *soak) createOp() churnOp {
	s.mu.Lock()
	s.nextID++
	id := s.nextID
	s.mu.Unlock()
	r := s.rng.Float64()
	var ns *nsRec
	mode := ""
	var kind podKind
	switch {
	case r < 0.42:
		ns = s.nss[0]
	case r < 0.52:
		ns, mode = s.nss[0], podmeta.ModeNone
	case r < 0.66:
		ns = s.nss[1]
	case r < 0.76:
		ns, mode = s.nss[1], podmeta.ModeAmbient
	case r < 0.93:
		ns = s.nss[2]
	case r < 0.965:
		ns, kind.sidecar = s.nss[0], true
	default:
		ns, kind.sidecar = s.nss[2], true
	}
	return churnOp{"create", func(ctx context.Context) { s.countOp("create", s.createPod(ctx, id, ns, mode, kind)) }}
}

// podKind: what else than its namespace and label a new pod is.
type podKind struct{ resident, sidecar bool }

func (s *soak) createPod(ctx context.Context, id int, ns *nsRec, mode string, kind podKind) error {
	var labels map[string]string
	if mode != "" {
		labels = map[string]string{podmeta.LabelDataplaneMode: mode}
	}
	name := fmt.Sprintf("p%05d", id)
	spec := e2eenv.PodSpec{Namespace: ns.name, Name: name, Labels: labels}
	if kind.sidecar {
		name = fmt.Sprintf("sc%05d", id)
		spec = s.sidecarSpec(ns.name, name)
	}
	s.mu.Lock()
	mesh := wantMesh(&podRec{ns: ns, podMode: mode, sidecar: kind.sidecar})
	policySince := ns.stableSince
	s.mu.Unlock()
	began := time.Now()
	p, err := s.env.CreatePod(ctx, spec)
	if err != nil {
		if !kind.sidecar {
			s.countAbsent(mesh, false, policySince, began, time.Now())
			s.judgePlainRefused(ns.name+"/"+name, mesh, policySince, began, time.Now(), err)
		}
		return err
	}
	if !kind.sidecar {
		s.countAbsent(mesh, true, policySince, began, time.Now())
	}
	s.judgeAbsentAdd(ns.name+"/"+name, p.UID, mesh, policySince, began, time.Now())
	s.created.Add(1)
	if kind.sidecar {
		s.sidecars.Add(1)
	}
	r := &podRec{id: id, ns: ns, name: name, p: p, uid: p.UID, podMode: mode, resident: kind.resident, sidecar: kind.sidecar}
	if err := r.listen(); err != nil {
		return errors.Join(err, s.env.DeletePod(ctx, p))
	}
	s.mu.Lock()
	r.stableSince = time.Now()
	r.sidecarRules = kind.sidecar && !s.conflistInFlux(began, r.stableSince)
	s.pods[id] = r
	s.mu.Unlock()
	return nil
}

// sidecarSpec is a pod as Istio's injector makes it in CNI mode (the
// golden case's labels, annotations and containers: istio-proxy,
// istio-validation, sidecar.istio.io/status).
func (s *soak) sidecarSpec(ns, name string) e2eenv.PodSpec {
	return e2eenv.InjectedPodSpec(s.sidecarGolden.Injected, ns, name)
}

// listen starts the app in the pod's (current) netns, and in a sidecar pod
// the stand-in for its proxy on Envoy's capture ports. Under r.mu or before
// the pod is shared.
func (r *podRec) listen() error {
	ports := map[int]string{appPort: "app " + r.name}
	if r.sidecar {
		ports[envoyOutboundPort] = sidecarAnswerPrefix + r.name
		ports[envoyInboundPort] = sidecarAnswerPrefix + r.name
	}
	r.lns = nil
	for _, port := range slices.Sorted(maps.Keys(ports)) {
		ln, err := r.p.Listen("tcp", fmt.Sprintf(":%d", port))
		if err != nil {
			r.closeListeners()
			return err
		}
		r.lns = append(r.lns, ln)
		go serveLine(ln, ports[port])
	}
	return nil
}

func (r *podRec) closeListeners() {
	for _, ln := range r.lns {
		ln.Close()
	}
	r.lns = nil
}

func (s *soak) deletePod(ctx context.Context, r *podRec) error {
	s.mu.Lock()
	if _, ok := s.pods[r.id]; !ok {
		s.mu.Unlock()
		return nil
	}
	delete(s.pods, r.id)
	s.mu.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.deleted = true
	r.closeListeners()
	s.deleted.Add(1)
	s.host.waitRuntimeConfig(ctx)
	return s.env.DeletePod(ctx, r.p)
}

// flipPodLabel cycles the pod's own label: none → ambient → "none" → none.
func (s *soak) flipPodLabel(ctx context.Context, r *podRec) error {
	s.mu.Lock()
	next := map[string]string{"": podmeta.ModeAmbient, podmeta.ModeAmbient: podmeta.ModeNone, podmeta.ModeNone: ""}[r.podMode]
	s.mu.Unlock()
	var val any = next
	if next == "" {
		val = nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{podmeta.LabelDataplaneMode: val}}})
	if _, err := s.env.CP.Admin.CoreV1().Pods(r.ns.name).Patch(ctx, r.name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	s.mu.Lock()
	r.podMode, r.stableSince = next, time.Now()
	s.mu.Unlock()
	return nil
}

// flipNamespace toggles the flip namespace's ambient label.
func (s *soak) flipNamespace(ctx context.Context) {
	ns := s.nss[2]
	s.mu.Lock()
	next := !ns.ambient
	s.mu.Unlock()
	var val any
	if next {
		val = podmeta.ModeAmbient
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{podmeta.LabelDataplaneMode: val}}})
	_, err := s.env.CP.Admin.CoreV1().Namespaces().Patch(ctx, ns.name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err == nil {
		s.mu.Lock()
		ns.ambient, ns.stableSince = next, time.Now()
		s.mu.Unlock()
	}
	s.countOp("ns-label-flip", err)
}

// recreate makes the pod's sandbox again (new netns, new IP), through the
// chain with our plugin or without it.
func (s *soak) recreate(ctx context.Context, r *podRec, withoutPlugin bool) error {
	var chain *e2eenv.Chain
	if withoutPlugin {
		chain = s.env.PlainChain
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.deleted {
		return nil
	}
	r.closeListeners()
	s.mu.Lock()
	mesh, policySince := wantMesh(r) && !withoutPlugin, stable(r)
	s.mu.Unlock()
	s.host.waitRuntimeConfig(ctx) // the old sandbox's DEL (waitRuntimeConfig)
	began := time.Now()
	_, err := s.env.RecreateSandbox(ctx, r.p, e2eenv.SandboxOptions{Chain: chain})
	if err != nil {
		if !withoutPlugin && !r.sidecar {
			s.countAbsent(mesh, false, policySince, began, time.Now())
			s.judgePlainRefused(r.ns.name+"/"+r.name, mesh, policySince, began, time.Now(), err)
		}
		// The old sandbox is gone and no new one was made (e.g. the ADD
		// found no agent): the runtime would retry; the soak deletes the
		// pod instead, so no pod without a sandbox is sampled.
		s.mu.Lock()
		delete(s.pods, r.id)
		s.mu.Unlock()
		r.deleted = true
		s.deleted.Add(1)
		_ = s.env.DeletePod(ctx, r.p) // its sandbox is gone already: only the object matters
		return err
	}
	if !withoutPlugin && !r.sidecar {
		s.countAbsent(mesh, true, policySince, began, time.Now())
	}
	s.judgeAbsentAdd(r.ns.name+"/"+r.name, r.uid, mesh, policySince, began, time.Now())
	s.mu.Lock()
	r.stableSince = time.Now()
	r.sidecarRules = r.sidecar && !withoutPlugin && !s.conflistInFlux(began, r.stableSince)
	s.mu.Unlock()
	return r.listen()
}

// judgeAbsentAdd judges a sandbox made through the chain with our plugin
// that succeeded (from began to ended): a pod in the mesh by the soak's
// own labels (mesh, unchanged since policySince), made while no agent
// process ran at any moment of it (the soak's own record of stopping and
// starting it) and with our plugin surely in the conflist, started
// uncaptured with nobody to enroll it — the plugin must refuse it until an
// agent answers.
func (s *soak) judgeAbsentAdd(pod, uid string, mesh bool, policySince, began, ended time.Time) {
	if !mesh || !policySince.Before(began) || s.conflistInFlux(began, ended) || !s.rec.agentGoneThrough(began, ended) {
		return
	}
	s.rec.violation(violation{At: began, Kind: kindAbsentAdd, Pod: pod, UID: uid,
		Detail: fmt.Sprintf("its sandbox was made through our plugin in %v, all of it while no agent process ran", ended.Sub(began).Round(time.Millisecond))})
}

// countAbsent counts an ADD through our plugin (not a sidecar pod's) that
// the absence verdicts judge: made wholly while no agent process ran, the
// API server up, the runtime's config ours throughout and the pod's policy
// unchanged since before it. The summary gives the counts: what the
// plugin did while no agent answered.
func (s *soak) countAbsent(mesh, started bool, policySince, began, ended time.Time) {
	if !policySince.Before(began) || s.conflistInFlux(began, ended) || s.rec.overlaps("apiserver-stop", began, ended) || !s.rec.agentGoneThrough(began, ended) {
		return
	}
	s.absentAdds[b2i(mesh)][b2i(started)].Add(1)
	// The agent renewed its lease until it exited: an ADD that began a
	// TTL after that met a lease past its TTL.
	if !mesh && started && began.Sub(s.rec.goneSince(began)) > s.cfg.leaseTTLOr() {
		s.plainPastTTL.Add(1)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// judgePlainRefused judges a sandbox made through the runtime's config
// (our plugin in it) that failed (from began to ended) with a plugin's
// error: a pod outside the mesh by the soak's own labels (unchanged since
// policySince; never a sidecar pod, which waits like a mesh pod), all of
// it while no agent process ran, the API server up (no apiserver-stop in
// flight) and the runtime's config ours throughout. The plugin reads the
// pod and its namespace from the API and must let such a pod start: only
// mesh pods wait for the agent (docs/install.md, "While no agent
// answers").
func (s *soak) judgePlainRefused(pod string, mesh bool, policySince, began, ended time.Time, err error) {
	cerr, ok := e2eenv.IsCNIError(err)
	if mesh || !ok || !policySince.Before(began) || s.conflistInFlux(began, ended) || s.rec.overlaps("apiserver-stop", began, ended) || !s.rec.agentGoneThrough(began, ended) {
		return
	}
	s.rec.violation(violation{At: began, Kind: kindPlainRefused, Pod: pod,
		Detail: fmt.Sprintf("its ADD failed in %v, all of it while no agent process ran and the API server was up: code %d %s", ended.Sub(began).Round(time.Millisecond), cerr.Code, cerr.Msg)})
}

// teardownPods deletes every pod the soak made, the prober last.
func (s *soak) teardownPods(ctx context.Context) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for _, r := range s.alive() {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			s.countOp("delete (end)", s.deletePod(ctx, r))
		})
	}
	wg.Wait()
	if s.dnsConn != nil {
		s.dnsConn.Close()
	}
	if s.prober != nil {
		s.countOp("delete (end)", s.env.DeletePod(ctx, s.prober))
	}
}

// readLine dials with d and reads one line (what the far end answered).
func readLine(ctx context.Context, dial func(context.Context) (net.Conn, error)) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	c, err := dial(ctx)
	if err != nil {
		return "", err
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetReadDeadline(dl)
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(line), nil
}
