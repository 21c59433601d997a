package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/settings"
)

// rulesCmd prints the exact iptables-restore text ambientd would apply for
// the given options and pod annotations. It builds the rule set as data and
// renders it; it touches no kernel state and needs no privileges.
func rulesCmd(args []string) int {
	return runRules(args, os.Stdout, os.Stderr)
}

// listFlag collects a repeatable flag; commas also separate values.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error {
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// annFlag collects repeatable --annotation key=value pairs.
type annFlag map[string]string

func (a annFlag) String() string { return fmt.Sprint(map[string]string(a)) }
func (a annFlag) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("annotation %q: want key=value", v)
	}
	a[k] = val
	return nil
}

func runRules(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("ambientd rules", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfg     iptables.Config
		reroute listFlag
		ann     = annFlag{}
		family  = fs.String("family", "", `address family to print: "4", "6" or "all" (default: all, or 4 with --ipv6=false); one family's output pipes straight into (ip6)iptables-restore --noflush`)
		host    = fs.Bool("host", false, "print the node's probe SNAT rules instead of the in-pod rules")
		del     = fs.Bool("delete", false, "print the batch that removes the rules instead of the one that installs them")
		nft     = fs.Bool("nftables", false, "print the native nftables rules (as `nft list` shows them) of --iptables nftables instead of iptables-restore text")
		sc      = fs.Bool("sidecar", false, "print the rules of a sidecar pod (an istio-proxy injected by Istio): from --pod, or from --annotation (traffic.sidecar.istio.io/*, sidecar.istio.io/interceptionMode) and the --proxy-* flags")
		side    = sidecarArgs{proxyEnv: annFlag{}}
	)
	fs.StringVar(&side.podFile, "pod", "", "with --sidecar: the injected pod (YAML or JSON; - for stdin), e.g. kubectl get pod -o yaml")
	fs.Var(&side.ips, "pod-ip", "with --sidecar: the pod's addresses (repeatable; default the pod's status, else an IPv4 pod): the first decides IPv6 as in Istio")
	fs.Var(side.proxyEnv, "proxy-env", "with --sidecar: istio-proxy env NAME=VALUE (repeatable): ISTIO_META_DNS_CAPTURE, ISTIO_DUAL_STACK, INVALID_DROP")
	fs.Int64Var(&side.proxyUID, "proxy-uid", iptables.DefaultProxyID, "with --sidecar: istio-proxy's runAsUser")
	fs.Int64Var(&side.proxyGID, "proxy-gid", iptables.DefaultProxyID, "with --sidecar: istio-proxy's runAsGroup")
	fs.BoolVar(&cfg.IPv6, "ipv6", iptables.DefaultIPv6, "capture IPv6 too, as the agent does by default: add ip6tables rules")
	var dnsCapture bool
	fs.BoolVar(&dnsCapture, "dns-capture", agent.DefaultConfig().DNSCapture, "capture DNS by default, as the agent does (pods may override with the "+podmeta.AnnotationDNSCapture+" annotation)")
	fs.Var(&reroute, "reroute-interface", "virtual interface whose TCP goes to ztunnel's outbound port (repeatable, or comma separated)")
	fs.Var(ann, "annotation", "pod annotation key=value (repeatable), e.g. "+podmeta.AnnotationBypassInbound+"=true")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: ambientd rules [flags]\n\nPrints the exact iptables-restore text for the given options, touching nothing.\n\n")
		fs.PrintDefaults()
	}
	// No variables: it prints what is asked.
	if err := settings.Parse(fs, args, nil, nil); err != nil {
		if !settings.IsUsageError(err) && !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(stderr, "ambientd rules: %v\n", err) // fs printed the others
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "ambientd rules: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if *sc {
		return printSidecar(side, ann, *family, *nft, *del, stdout, stderr)
	}
	cfg.RerouteInterfaces = reroute
	if err := cfg.Validate(); err != nil {
		fmt.Fprintf(stderr, "ambientd rules: %v\n", err)
		return 2
	}
	fams, err := families(*family, cfg.IPv6)
	if err != nil {
		fmt.Fprintf(stderr, "ambientd rules: %v\n", err)
		return 2
	}
	if len(fams) > 0 && fams[len(fams)-1] == iptables.IPv6 {
		cfg.IPv6 = true
	}

	if *nft {
		return printNFT(cfg, dnsCapture, ann, *host, *del, stdout, stderr)
	}
	var rs iptables.RuleSet
	if *host {
		if len(ann) > 0 {
			fmt.Fprintln(stderr, "ambientd rules: --annotation applies to pod rules, not --host")
			return 2
		}
		rs = iptables.BuildHostRules(cfg)
	} else {
		opts, err := podopts.PodOptions(dnsCapture, ann)
		if err != nil {
			fmt.Fprintf(stderr, "ambientd rules: %v\n", err)
			return 2
		}
		rs = iptables.BuildPodRules(cfg, opts)
	}

	for i, f := range fams {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		fmt.Fprintf(stdout, "# %s-restore --noflush --wait\n", f)
		for _, l := range notes(f, *host, *del) {
			fmt.Fprintln(stdout, "# "+l)
		}
		if *del {
			fmt.Fprint(stdout, rs.RenderDelete(f))
		} else {
			fmt.Fprint(stdout, rs.RenderApply(f))
		}
	}
	return 0
}

// printNFT prints the nftables backend's tables (one inet table set covers
// both families; --family picks IPv6 on or off).
func printNFT(cfg iptables.Config, dnsCapture bool, ann annFlag, host, del bool, stdout, stderr io.Writer) int {
	var rs iptables.NFTRuleSet
	if host {
		if len(ann) > 0 {
			fmt.Fprintln(stderr, "ambientd rules: --annotation applies to pod rules, not --host")
			return 2
		}
		rs = iptables.BuildHostRulesNFT(cfg, 0)
		fmt.Fprintln(stdout, "# the agent matches the kubelet's uid (meta skuid), found in /proc; 0 shown")
	} else {
		opts, err := podopts.PodOptions(dnsCapture, ann)
		if err != nil {
			fmt.Fprintf(stderr, "ambientd rules: %v\n", err)
			return 2
		}
		rs = iptables.BuildPodRulesNFT(cfg, opts)
	}
	if del {
		for _, t := range rs.TableNames() {
			fmt.Fprintf(stdout, "delete table inet %s\n", t)
		}
		return 0
	}
	fmt.Fprint(stdout, rs.Render())
	return 0
}

func families(s string, ipv6 bool) ([]iptables.Family, error) {
	switch s {
	case "":
		if ipv6 {
			return []iptables.Family{iptables.IPv4, iptables.IPv6}, nil
		}
		return []iptables.Family{iptables.IPv4}, nil
	case "4":
		return []iptables.Family{iptables.IPv4}, nil
	case "6":
		return []iptables.Family{iptables.IPv6}, nil
	case "all":
		return []iptables.Family{iptables.IPv4, iptables.IPv6}, nil
	}
	return nil, fmt.Errorf("--family %q: want 4, 6 or all", s)
}

// notes describes, as comments, what ambientd does next to the batch through
// netlink rather than iptables.
func notes(f iptables.Family, host, del bool) []string {
	v6 := f == iptables.IPv6
	if host {
		set, inet := iptables.ProbeSetV4, "inet"
		if v6 {
			set, inet = iptables.ProbeSetV6, "inet6"
		}
		if del {
			return []string{"then, via netlink: ipset destroy " + set}
		}
		return []string{
			fmt.Sprintf("first, via netlink: ipset create %s hash:ip family %s comment -exist", set, inet),
			fmt.Sprintf("pod IPs are added as: ipset add %s <ip> comment <pod uid> -exist", set),
		}
	}
	ip, dst := "ip", "0.0.0.0/0"
	if v6 {
		ip, dst = "ip -6", "::/0"
	}
	verb := "add"
	if del {
		verb = "del"
	}
	return []string{
		fmt.Sprintf("also, via netlink inside the pod: %s rule %s pref %d fwmark %#x/%#x lookup %d", ip, verb, iptables.RulePriority, iptables.ConnMark, iptables.MarkMask, iptables.RouteTable),
		fmt.Sprintf("and: %s route %s local %s dev lo table %d", ip, verb, dst, iptables.RouteTable),
	}
}
