package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"reflect"
	"runtime"
	"sort"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"

	"istio.io/istio/cni/pkg/plugin"
	istiolog "istio.io/istio/pkg/log"
	"istio.io/istio/tools/common/config"
	"istio.io/istio/tools/common/tproxy"
	"istio.io/istio/tools/istio-iptables/pkg/capture"
	"istio.io/istio/tools/istio-iptables/pkg/constants"
	dep "istio.io/istio/tools/istio-iptables/pkg/dependencies"
	nftbuilder "istio.io/istio/tools/istio-nftables/pkg/builder"
	nftcapture "istio.io/istio/tools/istio-nftables/pkg/capture"
)

// podAddrs are the interface addresses Istio's config reads inside the pod
// netns (config.LocalIPAddrs) to decide IPv6 support.
func podAddrs(f family) func() ([]net.Addr, error) {
	v4a := &net.IPNet{IP: net.ParseIP("10.244.0.17").To4(), Mask: net.CIDRMask(24, 32)}
	v6a := &net.IPNet{IP: net.ParseIP("fd00:10:244::11"), Mask: net.CIDRMask(64, 128)}
	lo := &net.IPNet{IP: net.ParseIP("127.0.0.1").To4(), Mask: net.CIDRMask(8, 32)}
	lo6 := &net.IPNet{IP: net.ParseIP("::1"), Mask: net.CIDRMask(128, 128)}
	var addrs []net.Addr
	switch f {
	case v4:
		addrs = []net.Addr{lo, v4a}
	case v6:
		addrs = []net.Addr{lo, lo6, v6a}
	case dual:
		addrs = []net.Addr{lo, v4a, lo6, v6a}
	}
	return func() ([]net.Addr, error) { return addrs, nil }
}

// redirectFieldsWant are the fields of Istio's plugin.Redirect this oracle
// knows how to map to config.Config exactly as the plugin's Program does
// (cni/pkg/plugin/sidecar_iptables_linux.go, sidecar_nftables_linux.go). A
// field added by a newer Istio fails the run rather than being dropped.
var redirectFieldsWant = []string{
	"targetPort", "redirectMode", "noRedirectUID", "noRedirectGID",
	"includeIPCidrs", "excludeIPCidrs", "excludeInboundPorts", "excludeOutboundPorts",
	"includeInboundPorts", "includeOutboundPorts", "rerouteVirtualInterfaces",
	"excludeInterfaces", "dnsRedirect", "dualStack", "invalidDrop",
}

// redirectFields reads Istio's Redirect (unexported fields, read-only
// through reflection) as ordered name=value pairs.
func redirectFields(r *plugin.Redirect) ([][2]string, error) {
	v := reflect.ValueOf(r).Elem()
	t := v.Type()
	var got []string
	var out [][2]string
	for i := 0; i < t.NumField(); i++ {
		f := v.Field(i)
		var s string
		switch f.Kind() {
		case reflect.String:
			s = f.String()
		case reflect.Bool:
			s = fmt.Sprint(f.Bool())
		default:
			return nil, fmt.Errorf("plugin.Redirect.%s has unexpected kind %s", t.Field(i).Name, f.Kind())
		}
		got = append(got, t.Field(i).Name)
		out = append(out, [2]string{t.Field(i).Name, s})
	}
	if strings.Join(got, ",") != strings.Join(redirectFieldsWant, ",") {
		return nil, fmt.Errorf("plugin.Redirect fields changed: got %v, oracle maps %v", got, redirectFieldsWant)
	}
	return out, nil
}

// configFor builds the config.Config the plugin's Program builds from the
// Redirect, then fills it from the environment inside the "pod" (with the
// case's interface addresses), as Program does inside the netns.
func configFor(r *plugin.Redirect, f family) (*config.Config, error) {
	fields, err := redirectFields(r)
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	for _, kv := range fields {
		m[kv[0]] = kv[1]
	}
	cfg := config.DefaultConfig()
	cfg.HostFilesystemPodNetwork = true
	cfg.NetworkNamespace = "/var/run/netns/oracle-pod"
	cfg.ProxyPort = m["targetPort"]
	cfg.ProxyUID = m["noRedirectUID"]
	cfg.ProxyGID = m["noRedirectGID"]
	cfg.InboundInterceptionMode = m["redirectMode"]
	cfg.OutboundIPRangesInclude = m["includeIPCidrs"]
	cfg.InboundPortsExclude = m["excludeInboundPorts"]
	cfg.InboundPortsInclude = m["includeInboundPorts"]
	cfg.ExcludeInterfaces = m["excludeInterfaces"]
	cfg.OutboundPortsExclude = m["excludeOutboundPorts"]
	cfg.OutboundPortsInclude = m["includeOutboundPorts"]
	cfg.OutboundIPRangesExclude = m["excludeIPCidrs"]
	cfg.RerouteVirtualInterfaces = m["rerouteVirtualInterfaces"]
	cfg.RedirectDNS = m["dnsRedirect"] == "true"
	cfg.CaptureAllDNS = m["dnsRedirect"] == "true"
	cfg.DropInvalid = m["invalidDrop"] == "true"
	cfg.DualStack = m["dualStack"] == "true"
	config.LocalIPAddrs = podAddrs(f)
	if err := cfg.FillConfigFromEnvironment(); err != nil {
		return nil, fmt.Errorf("fill config: %w", err)
	}
	return cfg, nil
}

// restoreRecorder is an Istio dependencies implementation that records the
// iptables-restore input per binary instead of running anything; iptables-save
// answers empty (a fresh pod netns).
type restoreRecorder struct {
	input map[string]*bytes.Buffer
	other []string
}

func (r *restoreRecorder) Run(_ *istiolog.Scope, _ bool, cmd constants.IptablesCmd, v *dep.IptablesVersion,
	stdin io.ReadSeeker, args ...string,
) (*bytes.Buffer, error) {
	name := v.CmdToString(cmd)
	if cmd == constants.IPTablesRestore && stdin != nil {
		if r.input[name] == nil {
			r.input[name] = &bytes.Buffer{}
		}
		if _, err := io.Copy(r.input[name], stdin); err != nil {
			return nil, err
		}
		return &bytes.Buffer{}, nil
	}
	if cmd != constants.IPTablesSave {
		r.other = append(r.other, strings.Join(append([]string{name}, args...), " "))
	}
	return &bytes.Buffer{}, nil
}

func (r *restoreRecorder) DetectIptablesVersion(ipV6 bool) (dep.IptablesVersion, error) {
	return (&dep.DependenciesStub{}).DetectIptablesVersion(ipV6)
}

// iptablesRules runs Istio's iptables configurator (capture.Run) and returns
// the iptables-restore --noflush input per family ("" when not applied).
func iptablesRules(cfg *config.Config) (v4In, v6In string, err error) {
	rec := &restoreRecorder{input: map[string]*bytes.Buffer{}}
	ic, err := capture.NewIptablesConfigurator(cfg, rec)
	if err != nil {
		return "", "", err
	}
	if err := ic.Run(); err != nil {
		return "", "", err
	}
	if len(rec.other) > 0 {
		return "", "", fmt.Errorf("unexpected discrete iptables commands: %v", rec.other)
	}
	if b := rec.input["iptables-restore"]; b != nil {
		v4In = b.String()
	}
	if b := rec.input["ip6tables-restore"]; b != nil {
		v6In = b.String()
	}
	return v4In, v6In, nil
}

// nftRules runs Istio's native nftables configurator with its own mock
// provider (knftables.Fake) and returns the transaction it would hand to
// `nft -f` (knftables syntax).
func nftRules(cfg *config.Config) (string, error) {
	provider := func(family knftables.Family, table string) (nftbuilder.NftablesAPI, error) {
		return nftbuilder.NewMockNftables(family, table), nil
	}
	nc, err := nftcapture.NewNftablesConfigurator(cfg, provider)
	if err != nil {
		return "", err
	}
	tx, err := nc.Run()
	if err != nil {
		return "", err
	}
	return tx.String(), nil
}

// routeState runs Istio's tproxy.ConfigureRoutes for real in a fresh network
// namespace of its own (a locked thread that unshares and is then thrown
// away) and lists what it added: policy rules, routes of its table, loopback
// addresses. Only IPv6 (::6 on lo) and TPROXY (fwmark rule + local routes)
// add anything.
func routeState(cfg *config.Config) (string, error) {
	type result struct {
		s   string
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Never unlocked: the thread dies with this goroutine and its netns
		// with it.
		runtime.LockOSThread()
		s, err := routeStateHere(cfg)
		ch <- result{s, err}
	}()
	r := <-ch
	return r.s, r.err
}

func routeStateHere(cfg *config.Config) (string, error) {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return "", fmt.Errorf("unshare netns: %w", err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return "", err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return "", err
	}
	baseRules, err := ruleLines()
	if err != nil {
		return "", err
	}
	baseAddrs, err := addrLines(lo)
	if err != nil {
		return "", err
	}
	c := *cfg
	c.DryRun = false
	if err := tproxy.ConfigureRoutes(&c); err != nil {
		return "", fmt.Errorf("ConfigureRoutes: %w", err)
	}
	var out []string
	rules, err := ruleLines()
	if err != nil {
		return "", err
	}
	out = append(out, minus(rules, baseRules)...)
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		routes, err := netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_UNSPEC},
			netlink.RT_FILTER_TABLE)
		if err != nil {
			return "", err
		}
		for _, r := range routes {
			if r.Table == unix.RT_TABLE_MAIN || r.Table == unix.RT_TABLE_LOCAL || r.Table == unix.RT_TABLE_DEFAULT {
				continue
			}
			out = append(out, fmt.Sprintf("route %s type %s dst %s dev lo scope %s table %d",
				famName(fam), routeType(r.Type), r.Dst, r.Scope, r.Table))
		}
	}
	addrs, err := addrLines(lo)
	if err != nil {
		return "", err
	}
	out = append(out, minus(addrs, baseAddrs)...)
	sort.Strings(out)
	if len(out) == 0 {
		return "", nil
	}
	return strings.Join(out, "\n") + "\n", nil
}

func ruleLines() ([]string, error) {
	var out []string
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rules, err := netlink.RuleList(fam)
		if err != nil {
			return nil, err
		}
		for _, r := range rules {
			mark := ""
			if r.Mark != 0 {
				mark = fmt.Sprintf(" fwmark %#x", r.Mark)
				if r.Mask != nil {
					mark += fmt.Sprintf("/%#x", *r.Mask)
				}
			}
			out = append(out, fmt.Sprintf("rule %s priority %d%s lookup %d", famName(fam), r.Priority, mark, r.Table))
		}
	}
	return out, nil
}

func addrLines(link netlink.Link) ([]string, error) {
	addrs, err := netlink.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, a := range addrs {
		fam := netlink.FAMILY_V4
		if a.IP.To4() == nil {
			fam = netlink.FAMILY_V6
		}
		out = append(out, fmt.Sprintf("addr %s %s dev lo", famName(fam), a.IPNet))
	}
	return out, nil
}

func minus(after, before []string) []string {
	seen := map[string]int{}
	for _, s := range before {
		seen[s]++
	}
	var out []string
	for _, s := range after {
		if seen[s] > 0 {
			seen[s]--
			continue
		}
		out = append(out, s)
	}
	return out
}

func famName(f int) string {
	if f == netlink.FAMILY_V6 {
		return "inet6"
	}
	return "inet"
}

func routeType(t int) string {
	if t == unix.RTN_LOCAL {
		return "local"
	}
	return fmt.Sprint(t)
}

// redirectFor runs the plugin's own pod parsing: ExtractPodInfo + NewRedirect.
func redirectFor(pod *corev1.Pod) (*plugin.Redirect, error) {
	return plugin.NewRedirect(plugin.ExtractPodInfo(pod))
}
