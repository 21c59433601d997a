// Command soak is the soak under faults (`make soak`, docs/soak.md): on the
// end-to-end environment (kube-apiserver + etcd, bin/ambientd installing
// bin/ambientd-cni into a host-like CNI tree the runtime (libcni) reads:
// install.go, bin/ztunnel-emulator in netns mode) it
// churns pods for a while — creates and deletes in ambient, plain and
// opted-out namespaces, sidecar-mode pods among them, flips namespace and
// pod labels, recreates sandboxes with and without our plugin — while
// faults are injected at random (seeded) times, and an invariant sampler,
// which reads only the API's claims, the emulators' state and real
// connections, judges every pod several times a second: bypass, black hole
// while a ztunnel serves, a restored pod left unverified, a sidecar pod in
// ambient, the plugin's decisions while no agent runs, the runtime's config
// following its primary, lost pod, and leaks at the end.
// It prints a summary, writes the timeline's data (timeline.go; test/soakplot
// draws it) and ends with one line:
//
//	soak: <pods> pods, <faults> faults, <samples> samples, <violations> violations
//
// It exits 1 when there was any violation.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// config is the soak's settings; each flag has an environment variable.
type config struct {
	duration time.Duration
	pods     int
	seed     int64
	out      string // directory for summary.txt and timeline.json
	// agentArgs are extra flags for `ambientd run` (after the soak's own).
	agentArgs []string
	// agentBin, when set, is the agent binary run instead of bin/ambientd
	// (a build made on purpose with a known bug: docs/soak.md).
	agentBin string
	// pluginBin, when set, is the CNI plugin the agent installs instead of
	// bin/ambientd-cni (--cni-bin-source; a build made on purpose with a
	// known bug).
	pluginBin string
	// nsSuffix follows the seed in the run's namespace names, so that
	// two runs of one seed on one environment (the package's tests) do
	// not meet each other's namespaces.
	nsSuffix string
	// leaseTTL is the agent's --cni-install-lease-ttl: short, so that
	// agent outages outlast it within a run.
	leaseTTL time.Duration
	// rules is the agent's --iptables: auto (the default, what users
	// install: native nftables on a clean node) or nft (iptables-nft).
	rules string
	// faults are the fault kinds injected (default: all).
	faults []string
	// verifyInterval is the agent's --verify-interval (drift pass); the
	// bypass bound follows from it.
	verifyInterval time.Duration
}

func main() {
	c, err := parseConfig(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(2)
	}
	opts := e2eenv.Options{NodeName: "soak-node", AmbientPlugin: true, Subnet: netip.MustParsePrefix("10.88.0.0/20")}
	os.Exit(e2eenv.Program(opts, func(ctx context.Context, env *e2eenv.Env) int {
		res, err := run(ctx, env, c, os.Stderr)
		if err != nil {
			fmt.Fprintf(os.Stderr, "soak: %v\n", err)
			return 1
		}
		fmt.Print(res.summary())
		if err := res.write(c.out); err != nil {
			fmt.Fprintf(os.Stderr, "soak: %v\n", err)
			return 1
		}
		fmt.Println(res.lastLine())
		if res.violationCount() > 0 {
			return 1
		}
		return 0
	}))
}

func parseConfig(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("soak", flag.ContinueOnError)
	fs.DurationVar(&c.duration, "duration", e2eenv.EnvDuration("SOAK_DURATION", 2*time.Minute), "how long pods churn and faults are injected (env SOAK_DURATION)")
	fs.IntVar(&c.pods, "pods", e2eenv.EnvInt("SOAK_PODS", 24), "pods alive at once, about (env SOAK_PODS)")
	fs.Int64Var(&c.seed, "seed", int64(e2eenv.EnvInt("SOAK_SEED", 1)), "random seed: the same seed makes the same plan of churn and faults (env SOAK_SEED)")
	fs.StringVar(&c.out, "out", e2eenv.EnvString("SOAK_OUT", ".cache/soak"), "directory for summary.txt and timeline.json, the data make soak draws as timeline.png/.svg (env SOAK_OUT)")
	fs.StringVar(&c.agentBin, "agent-bin", os.Getenv("SOAK_AGENT_BIN"), "the agent binary to run instead of bin/ambientd (env SOAK_AGENT_BIN)")
	fs.StringVar(&c.pluginBin, "plugin-bin", os.Getenv("SOAK_PLUGIN_BIN"), "the CNI plugin binary the agent installs instead of bin/ambientd-cni (env SOAK_PLUGIN_BIN)")
	fs.DurationVar(&c.leaseTTL, "lease-ttl", e2eenv.EnvDuration("SOAK_LEASE_TTL", defaultLeaseTTL), "the agent's --cni-install-lease-ttl, short so that agent outages outlast it (env SOAK_LEASE_TTL)")
	fs.StringVar(&c.rules, "rules", e2eenv.EnvString("SOAK_RULES", "auto"), "the agent's rules backend (--iptables): auto, the default (native nftables on this clean node), or nft (iptables-nft) (env SOAK_RULES)")
	agentArgs := fs.String("agent-args", os.Getenv("SOAK_AGENT_ARGS"), "extra flags for `ambientd run`, space separated (env SOAK_AGENT_ARGS)")
	faults := fs.String("faults", e2eenv.EnvString("SOAK_FAULTS", strings.Join(allFaultKinds(), ",")), "fault kinds to inject, comma separated, or none (env SOAK_FAULTS)")
	fs.DurationVar(&c.verifyInterval, "verify-interval", e2eenv.EnvDuration("SOAK_VERIFY_INTERVAL", 5*time.Second), "the agent's --verify-interval; 0 turns the drift pass off (env SOAK_VERIFY_INTERVAL)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	c.agentArgs = strings.Fields(*agentArgs)
	if *faults != "none" && *faults != "" {
		c.faults = strings.Split(*faults, ",")
	}
	for _, f := range c.faults {
		if _, ok := faultKinds[f]; !ok {
			return c, fmt.Errorf("-faults: unknown kind %q (kinds: %s)", f, strings.Join(allFaultKinds(), ", "))
		}
	}
	if c.rules != "auto" && c.rules != "nft" {
		return c, fmt.Errorf("-rules %q: want auto or nft", c.rules)
	}
	if c.duration < 10*time.Second || c.pods < 2 || c.pods > 500 || c.verifyInterval < 0 || c.leaseTTL < time.Second {
		return c, fmt.Errorf("-duration must be at least 10s, -pods 2..500, -verify-interval 0 or more, -lease-ttl 1s or more")
	}
	return c, nil
}

// defaultLeaseTTL is the soak's install lease TTL: an agent-kill keeps
// the agent down 0.2–3 s (one in five 8–20 s), often longer than it.
const defaultLeaseTTL = 2 * time.Second

// leaseTTLOr is the agent's --cni-install-lease-ttl: defaultLeaseTTL
// unless set.
func (c config) leaseTTLOr() time.Duration {
	if c.leaseTTL == 0 {
		return defaultLeaseTTL
	}
	return c.leaseTTL
}

// rulesOr is the agent's --iptables: auto unless set.
func (c config) rulesOr() string {
	if c.rules == "" {
		return "auto"
	}
	return c.rules
}
