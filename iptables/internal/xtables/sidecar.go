package xtables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Sidecar mode: the chains Istio's node agent programs for a pod with an
// injected istio-proxy (istio-cni's sidecar mode). Istio's names and rule
// text, so a pod Istio's agent set up verifies clean and one we set up
// passes Istio's istio-validation. Unlike the ambient set, some of these
// rules live in the built-in chains themselves (interface exclusions, the
// TPROXY marks): those are ours by their exact text.
const (
	ChainSidecarInbound    = "ISTIO_INBOUND"
	ChainSidecarRedirect   = "ISTIO_REDIRECT"
	ChainSidecarInRedirect = "ISTIO_IN_REDIRECT"
	ChainSidecarOutput     = "ISTIO_OUTPUT"
	ChainSidecarOutputDNS  = "ISTIO_OUTPUT_DNS"
	ChainSidecarDivert     = "ISTIO_DIVERT"
	ChainSidecarTProxy     = "ISTIO_TPROXY"
	ChainSidecarDrop       = "ISTIO_DROP"
)

// sidecarChains are every chain the sidecar rules may own, per table: what
// verify and delete look for whatever the options.
var sidecarChains = map[string][]string{
	"nat":    {ChainSidecarInbound, ChainSidecarRedirect, ChainSidecarInRedirect, ChainSidecarOutput, ChainSidecarOutputDNS},
	"mangle": {ChainSidecarDivert, ChainSidecarTProxy, ChainSidecarInbound, ChainSidecarDrop},
	"raw":    {ChainSidecarOutputDNS, ChainSidecarInbound},
}

var sidecarTables = []string{"mangle", "nat", "raw"}

func builtin(chain string) bool {
	switch chain {
	case "PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING":
		return true
	}
	return false
}

// SidecarRuleSet is a pod's sidecar rules for one or two address families:
// per family, every rule (ours in our chains, ours in built-in chains) in
// the order the kernel holds them, and our chains per table. Data: render
// it, compare it, apply it.
type SidecarRuleSet struct {
	V4, V6 *SidecarFamily // V6 nil when the pod's IPv6 is not captured
}

// SidecarFamily is one family's sidecar rules.
type SidecarFamily struct {
	// Chains are our chains per table, in creation order.
	Chains map[string][]string
	// Rules are in kernel order within each chain.
	Rules []Rule
}

// Families returns the families the set has rules for.
func (rs SidecarRuleSet) Families() []rules.Family { return rules.Families(rs.V6 != nil) }

// Family returns one family's rules (nil when absent).
func (rs SidecarRuleSet) Family(f rules.Family) *SidecarFamily {
	if f == rules.IPv6 {
		return rs.V6
	}
	return rs.V4
}

// Tables returns the tables the family has rules in, in rendering order.
func (sf *SidecarFamily) Tables() []string {
	var out []string
	for _, t := range sidecarTables {
		if len(sf.Chains[t]) > 0 || slices.ContainsFunc(sf.Rules, func(r Rule) bool { return r.Table == t }) {
			out = append(out, t)
		}
	}
	return out
}

// ChainRules returns the rule args of one chain, in order.
func (sf *SidecarFamily) ChainRules(table, chain string) []string {
	var out []string
	for _, r := range sf.Rules {
		if r.Table == table && r.Chain == chain {
			out = append(out, strings.Join(r.Args, " "))
		}
	}
	return out
}

// builtinChains returns the built-in chains of table the family has rules
// in, in first-use order.
func (sf *SidecarFamily) builtinChains(table string) []string {
	var out []string
	for _, r := range sf.Rules {
		if r.Table == table && builtin(r.Chain) && !slices.Contains(out, r.Chain) {
			out = append(out, r.Chain)
		}
	}
	return out
}

// chainList builds one family's rules the way Istio's builder does: rules
// appended or inserted at a 1-based position (iptables -I), so the kernel
// order is data, not an accident of rendering.
type chainList struct {
	order []string // "table/chain" in first-use order
	rules map[string][][]string
}

func (l *chainList) at(table, chain string) string {
	k := table + "/" + chain
	if l.rules == nil {
		l.rules = map[string][][]string{}
	}
	if _, ok := l.rules[k]; !ok {
		l.order = append(l.order, k)
		l.rules[k] = nil
	}
	return k
}

func (l *chainList) add(table, chain string, args ...string) {
	k := l.at(table, chain)
	l.rules[k] = append(l.rules[k], args)
}

func (l *chainList) insert(table, chain string, pos int, args ...string) {
	k := l.at(table, chain)
	i := min(max(pos-1, 0), len(l.rules[k]))
	l.rules[k] = slices.Insert(l.rules[k], i, args)
}

func (l *chainList) family() *SidecarFamily {
	sf := &SidecarFamily{Chains: map[string][]string{}}
	for _, k := range l.order {
		table, chain, _ := strings.Cut(k, "/")
		if !builtin(chain) {
			sf.Chains[table] = append(sf.Chains[table], chain)
		}
		for _, args := range l.rules[k] {
			sf.Rules = append(sf.Rules, Rule{Table: table, Chain: chain, Args: args})
		}
	}
	// A chain only jumped to (never given a rule) is ours too.
	for _, r := range sf.Rules {
		if target, ok := JumpTarget(strings.Join(r.Args, " ")); ok && slices.Contains(sidecarChains[r.Table], target) &&
			!slices.Contains(sf.Chains[r.Table], target) {
			sf.Chains[r.Table] = append(sf.Chains[r.Table], target)
		}
	}
	return sf
}

func fields(s string) []string { return strings.Fields(s) }

// BuildSidecarRules returns a pod's sidecar rules: what Istio's istio-cni
// programs for the same pod (the oracle tests compare them chain by chain
// with Istio's own builder), in the canonical text iptables-save prints.
func BuildSidecarRules(o rules.SidecarOptions) SidecarRuleSet {
	rs := SidecarRuleSet{V4: sidecarFamily(rules.IPv4, o)}
	if o.IPv6 {
		rs.V6 = sidecarFamily(rules.IPv6, o)
	}
	return rs
}

func sidecarFamily(f rules.Family, o rules.SidecarOptions) *SidecarFamily {
	var (
		l      chainList
		lo     = localhost(f)
		pass   = hostPrefix(rules.SidecarInboundPassthrough(f))
		tmark  = hex(rules.SidecarTProxyMark)
		omark  = hex(rules.SidecarOutboundMark)
		full   = "/0xffffffff"
		tunnel = strconv.Itoa(rules.SidecarTunnelPort)
		port   = func(p uint16) string { return strconv.Itoa(int(p)) }
		uid    = strconv.FormatUint(uint64(o.ProxyUID), 10)
		gid    = strconv.FormatUint(uint64(o.ProxyGID), 10)
		onIP   = "0.0.0.0"
		inTbl  = "nat"
	)
	if f == rules.IPv6 {
		onIP = "::"
	}
	if o.TProxy() {
		inTbl = "mangle"
	}

	// Traffic on an excluded interface is never captured.
	for _, i := range o.ExcludeInterfaces {
		l.add("nat", "PREROUTING", "-i", i, "-j", "RETURN")
		l.add("nat", "OUTPUT", "-o", i, "-j", "RETURN")
	}
	if o.TProxy() {
		for _, i := range o.ExcludeInterfaces {
			l.add("mangle", "PREROUTING", "-i", i, "-j", "RETURN")
			l.add("mangle", "OUTPUT", "-o", i, "-j", "RETURN")
		}
	}
	// A VM's interface is not inbound traffic of the pod (its TCP is
	// captured as outbound below, inserted before this).
	for _, i := range o.RerouteInterfaces {
		l.insert("nat", "PREROUTING", 1, "-i", i, "-j", "RETURN")
	}
	if o.InvalidDrop {
		l.add("mangle", "PREROUTING", fields("-m conntrack --ctstate INVALID -j "+ChainSidecarDrop)...)
		l.add("mangle", ChainSidecarDrop, "-j", "DROP")
	}
	l.add("nat", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+tunnel+" -j RETURN")...)
	l.add("nat", ChainSidecarRedirect, fields("-p tcp -j REDIRECT --to-ports "+strconv.Itoa(rules.SidecarOutboundPort))...)
	l.add("nat", ChainSidecarInRedirect, fields("-p tcp -j REDIRECT --to-ports "+strconv.Itoa(rules.SidecarInboundPort))...)

	// Inbound.
	if o.InboundCaptured() {
		if o.TProxy() {
			l.add("mangle", ChainSidecarDivert, fields("-j MARK --set-xmark "+tmark+full)...)
			l.add("mangle", ChainSidecarDivert, "-j", "ACCEPT")
			l.add("mangle", ChainSidecarTProxy, fields("! -d "+lo+" -p tcp -j TPROXY --on-port "+strconv.Itoa(rules.SidecarInboundPort)+
				" --on-ip "+onIP+" --tproxy-mark "+tmark+full)...)
		}
		l.add(inTbl, "PREROUTING", "-p", "tcp", "-j", ChainSidecarInbound)
		if o.IncludeAllInbound {
			for _, p := range o.ExcludeInboundPorts {
				l.add(inTbl, ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -j RETURN")...)
			}
			if o.TProxy() {
				l.add("mangle", ChainSidecarInbound, fields("-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j "+ChainSidecarDivert)...)
				l.add("mangle", ChainSidecarInbound, "-p", "tcp", "-j", ChainSidecarTProxy)
			} else {
				l.add("nat", ChainSidecarInbound, "-p", "tcp", "-j", ChainSidecarInRedirect)
			}
		} else {
			for _, p := range o.IncludeInboundPorts {
				if o.TProxy() {
					l.add("mangle", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -m conntrack --ctstate RELATED,ESTABLISHED -j "+ChainSidecarDivert)...)
					l.add("mangle", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -j "+ChainSidecarTProxy)...)
				} else {
					l.add("nat", ChainSidecarInbound, fields("-p tcp -m tcp --dport "+port(p)+" -j "+ChainSidecarInRedirect)...)
				}
			}
		}
	}

	// Outbound.
	l.add("nat", "OUTPUT", "-j", ChainSidecarOutput)
	for _, p := range o.ExcludeOutboundPorts {
		l.add("nat", ChainSidecarOutput, fields("-p tcp -m tcp --dport "+port(p)+" -j RETURN")...)
		l.add("nat", ChainSidecarOutput, fields("-p udp -m udp --dport "+port(p)+" -j RETURN")...)
	}
	// Envoy's inbound passthrough (bound to 127.0.0.6) is not captured.
	l.add("nat", ChainSidecarOutput, fields("-s "+pass+" -o lo -j RETURN")...)
	owner := func(kind, id string, dnsException bool) {
		// The proxy calling the pod's own address (a service VIP that
		// resolved to this pod) goes through Envoy's inbound side.
		if dnsException {
			l.add("nat", ChainSidecarOutput, fields("! -d "+lo+" -o lo -p tcp -m multiport ! --dports 53,"+tunnel+
				" -m owner --"+kind+"-owner "+id+" -j "+ChainSidecarInRedirect)...)
		} else {
			l.add("nat", ChainSidecarOutput, fields("! -d "+lo+" -o lo -p tcp -m tcp ! --dport "+tunnel+
				" -m owner --"+kind+"-owner "+id+" -j "+ChainSidecarInRedirect)...)
		}
		// Other loopback traffic is the app talking to itself.
		if !o.IncludesLoopback() {
			if o.DNS {
				l.add("nat", ChainSidecarOutput, fields("-o lo -p tcp -m tcp ! --dport 53 -m owner ! --"+kind+"-owner "+id+" -j RETURN")...)
			} else {
				l.add("nat", ChainSidecarOutput, fields("-o lo -m owner ! --"+kind+"-owner "+id+" -j RETURN")...)
			}
		}
		// The proxy's own traffic is never captured again.
		l.add("nat", ChainSidecarOutput, fields("-m owner --"+kind+"-owner "+id+" -j RETURN")...)
	}
	owner("uid", uid, o.DNS)
	owner("gid", gid, false)
	if o.DNS {
		dns := strconv.Itoa(rules.SidecarDNSPort)
		l.add("raw", "OUTPUT", "-j", ChainSidecarOutputDNS)
		l.add("nat", ChainSidecarOutput, "-j", ChainSidecarOutputDNS)
		l.add("nat", ChainSidecarOutputDNS, fields("-p tcp -m tcp --dport 53 -j REDIRECT --to-ports "+dns)...)
		l.add("nat", ChainSidecarOutputDNS, fields("-p udp -m udp --dport 53 -j REDIRECT --to-ports "+dns)...)
		// The proxy's upstream queries (zone 1) never share conntrack
		// entries with the app's queries it answers (zone 2).
		for _, id := range []struct{ kind, v string }{{"uid", uid}, {"gid", gid}} {
			l.add("raw", ChainSidecarOutputDNS, fields("-p udp -m udp --dport 53 -m owner --"+id.kind+"-owner "+id.v+" -j CT --zone 1")...)
			l.add("raw", ChainSidecarOutputDNS, fields("-p udp -m udp --sport "+dns+" -m owner --"+id.kind+"-owner "+id.v+" -j CT --zone 2")...)
		}
		l.add("raw", "PREROUTING", "-j", ChainSidecarInbound)
		l.add("raw", ChainSidecarOutputDNS, fields("-p udp -m udp --dport 53 -j CT --zone 2")...)
		l.add("raw", ChainSidecarInbound, fields("-p udp -m udp --sport 53 -j CT --zone 1")...)
	}
	l.add("nat", ChainSidecarOutput, "-d", lo, "-j", "RETURN")
	for _, c := range rules.OutboundCIDRs(o.ExcludeOutboundCIDRs, f) {
		l.add("nat", ChainSidecarOutput, "-d", cidr(c), "-j", "RETURN")
	}
	for _, p := range o.IncludeOutboundPorts {
		l.add("nat", ChainSidecarOutput, fields("-p tcp -m tcp --dport "+port(p)+" -j "+ChainSidecarRedirect)...)
	}
	if o.IncludeAllOutbound {
		l.add("nat", ChainSidecarOutput, "-j", ChainSidecarRedirect)
		for _, i := range o.RerouteInterfaces {
			l.insert("nat", "PREROUTING", 1, "-i", i, "-j", ChainSidecarRedirect)
		}
	} else {
		for _, c := range rules.OutboundCIDRs(o.IncludeOutboundCIDRs, f) {
			for _, i := range o.RerouteInterfaces {
				l.insert("nat", "PREROUTING", 1, "-d", cidr(c), "-i", i, "-j", ChainSidecarRedirect)
			}
			l.add("nat", ChainSidecarOutput, "-d", cidr(c), "-j", ChainSidecarRedirect)
		}
	}

	if o.TProxy() {
		// Envoy's original-src mark survives as the connection's mark;
		// the pod's replies get it back and take the TPROXY route.
		l.add("mangle", "PREROUTING", fields("-p tcp -m mark --mark "+tmark+" -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff")...)
		l.add("mangle", "OUTPUT", fields("-o lo -p tcp -m mark --mark "+tmark+" -j RETURN")...)
		for _, id := range []struct{ kind, v string }{{"uid", uid}, {"gid", gid}} {
			l.add("mangle", "OUTPUT", fields("! -d "+lo+" -o lo -p tcp -m owner --"+id.kind+"-owner "+id.v+" -j MARK --set-xmark "+omark+full)...)
		}
		l.add("mangle", "OUTPUT", fields("-p tcp -m connmark --mark "+tmark+" -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff")...)
		l.insert("mangle", ChainSidecarInbound, 1, fields("-p tcp -m mark --mark "+tmark+" -j RETURN")...)
		l.insert("mangle", ChainSidecarInbound, 2, fields("-s "+pass+" -i lo -p tcp -j RETURN")...)
		l.insert("mangle", ChainSidecarInbound, 3, fields("-i lo -p tcp -m mark ! --mark "+omark+" -j RETURN")...)
	}
	return l.family()
}

// cidr is a prefix as iptables-save prints it (host bits cleared).
func cidr(p netip.Prefix) string { return p.Masked().String() }

// RenderApply returns the iptables-restore --noflush batch that installs
// one family's rules into a namespace holding none of our sidecar chains:
// our chains are created with -N, so on a namespace that has them the batch
// fails as a whole and the backend repairs from the state instead.
func (rs SidecarRuleSet) RenderApply(f rules.Family) string {
	sf := rs.Family(f)
	var b strings.Builder
	for _, t := range sf.Tables() {
		fmt.Fprintf(&b, "*%s\n", t)
		for _, c := range sf.Chains[t] {
			fmt.Fprintf(&b, "-N %s\n", c)
		}
		for _, r := range sf.Rules {
			if r.Table == t {
				b.WriteString(r.Spec() + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// staleChains returns the sidecar chains of table present in ts that are
// not among ours. The ambient rules' ISTIO_OUTPUT (a chain name of both
// modes) is not a sidecar chain: it is the ambient set's when that set's
// ISTIO_PRERT exists beside it.
func staleChains(table string, ts *tableState, ours []string) []string {
	var out []string
	for _, c := range sidecarChains[table] {
		if ts.chains[c] && !slices.Contains(ours, c) && !ambientChain(c, ts) {
			out = append(out, c)
		}
	}
	return out
}

func ambientChain(c string, ts *tableState) bool {
	return c == ChainOutput && ts.chains[ChainPrerouting]
}

// foreignJump reports whether a rule jumping to target is one of ours to
// remove: a jump into a sidecar chain that is not wanted.
func foreignJump(table, target string, ts *tableState, ours []string) bool {
	return slices.Contains(sidecarChains[table], target) && !slices.Contains(ours, target) && !ambientChain(target, ts)
}

// diff compares one family's wanted rules (nil: none wanted) with a saved
// state: our chains with their rules in order, our built-in chain rules
// each once and in order among themselves (others' rules around them are
// left alone), and no other sidecar chain or jump into one.
func (sf *SidecarFamily) diff(f rules.Family, st saveState) rules.Drift {
	var d rules.Drift
	want := sf.orEmpty()
	for _, t := range sidecarTables {
		ts := st.table(t)
		prefix := fmt.Sprintf("%s -t %s ", f, t)
		ours := want.Chains[t]
		for _, c := range ours {
			if !ts.chains[c] {
				d.Missing = append(d.Missing, prefix+"-N "+c)
			}
			w, have := want.ChainRules(t, c), ts.rules[c]
			m, u := rules.MultisetDiff(w, have)
			for _, a := range m {
				d.Missing = append(d.Missing, prefix+"-A "+c+" "+a)
			}
			for _, a := range u {
				d.Unexpected = append(d.Unexpected, prefix+"-A "+c+" "+a)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(w, have) {
				d.Unexpected = append(d.Unexpected, prefix+c+": rules out of order")
			}
		}
		for _, c := range staleChains(t, ts, ours) {
			d.Unexpected = append(d.Unexpected, prefix+"-N "+c)
		}
		builtins := want.builtinChains(t)
		for _, chain := range ts.order {
			if builtin(chain) && !slices.Contains(builtins, chain) {
				builtins = append(builtins, chain)
			}
		}
		for _, chain := range builtins {
			w := want.ChainRules(t, chain)
			var have []string // ours among the chain's rules, in order
			for _, args := range ts.rules[chain] {
				target, jumps := JumpTarget(args)
				if slices.Contains(w, args) || jumps && foreignJump(t, target, ts, ours) {
					have = append(have, args)
				}
			}
			m, u := rules.MultisetDiff(w, have)
			for _, a := range m {
				d.Missing = append(d.Missing, prefix+"-A "+chain+" "+a)
			}
			for _, a := range u {
				d.Unexpected = append(d.Unexpected, prefix+"-A "+chain+" "+a)
			}
			if len(m) == 0 && len(u) == 0 && !slices.Equal(w, have) {
				d.Unexpected = append(d.Unexpected, prefix+chain+": our rules out of order")
			}
		}
	}
	return d
}

func (sf *SidecarFamily) orEmpty() *SidecarFamily {
	if sf == nil {
		return &SidecarFamily{Chains: map[string][]string{}}
	}
	return sf
}

// renderConverge returns a batch that turns the saved state of one family
// into exactly the wanted rules (nil: none), or "" when it already is.
// Our chains are declared with ":chain -" (under --noflush: created if
// missing, flushed if present) and refilled; every rule of ours in a
// built-in chain (wanted, or of the options old was built from) and any
// jump into an unwanted sidecar chain is deleted and the wanted ones
// appended; sidecar chains not wanted are flushed and deleted. One restore:
// the kernel commits each table at once.
func (sf *SidecarFamily) renderConverge(f rules.Family, st saveState, old *SidecarFamily) string {
	want := sf.orEmpty()
	dirty := !want.diff(f, st).Empty()
	var b strings.Builder
	for _, t := range sidecarTables {
		ts := st.table(t)
		ours := want.Chains[t]
		stale := staleChains(t, ts, ours)
		var drop []string // "CHAIN args" of ours in built-in chains
		for _, set := range []*SidecarFamily{old, want} {
			if set == nil {
				continue
			}
			for _, r := range set.Rules {
				if r.Table == t && builtin(r.Chain) {
					drop = append(drop, r.Chain+" "+strings.Join(r.Args, " "))
				}
			}
		}
		var dels []string
		for _, chain := range ts.order {
			for _, args := range ts.rules[chain] {
				target, jumps := JumpTarget(args)
				switch {
				case builtin(chain) && slices.Contains(drop, chain+" "+args),
					builtin(chain) && jumps && foreignJump(t, target, ts, ours),
					!builtin(chain) && !slices.Contains(sidecarChains[t], chain) && jumps && slices.Contains(stale, target):
					dels = append(dels, "-D "+chain+" "+args)
					if !slices.Contains(want.ChainRules(t, chain), args) {
						dirty = true // an old rule of ours still there
					}
				}
			}
		}
		var body strings.Builder
		for _, c := range ours {
			fmt.Fprintf(&body, ":%s - [0:0]\n", c)
		}
		for _, d := range dels {
			body.WriteString(d + "\n")
		}
		for _, c := range stale {
			fmt.Fprintf(&body, "-F %s\n", c)
		}
		for _, c := range stale {
			fmt.Fprintf(&body, "-X %s\n", c)
		}
		for _, r := range want.Rules {
			if r.Table == t {
				body.WriteString(r.Spec() + "\n")
			}
		}
		if body.Len() > 0 {
			fmt.Fprintf(&b, "*%s\n%sCOMMIT\n", t, body.String())
		}
	}
	if !dirty {
		return ""
	}
	return b.String()
}
