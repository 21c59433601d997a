package istiogolden

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Chains is a rule set as the kernel holds it: table -> chain -> rules in
// order. Golden restore input mixes -A and -I (Istio inserts at 1 for
// reroute interfaces and TPROXY), so the kernel order is not the line order:
// Replay applies the lines as the kernel would.
type Chains map[string]map[string][]string

func (c Chains) chain(table, chain string) {
	if c[table] == nil {
		c[table] = map[string][]string{}
	}
	if _, ok := c[table][chain]; !ok {
		c[table][chain] = nil
	}
}

// Names returns "table chain" of every chain, sorted.
func (c Chains) Names() []string {
	var out []string
	for t, chains := range c {
		for ch := range chains {
			out = append(out, t+" "+ch)
		}
	}
	slices.Sort(out)
	return out
}

// ReplayIPTables applies iptables-restore input (-N, -A, -I n) to empty
// tables; canon rewrites each rule's args (nil: as written).
func ReplayIPTables(text string, canon func(string) string) (Chains, error) {
	out := Chains{}
	table := ""
	for n, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		f := strings.Fields(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			table = strings.TrimSpace(line[1:])
		case line == "COMMIT":
		case len(f) >= 2 && f[0] == "-N":
			out.chain(table, f[1])
		case len(f) >= 3 && f[0] == "-A":
			args := strings.Join(f[2:], " ")
			if canon != nil {
				args = canon(args)
			}
			out.chain(table, f[1])
			out[table][f[1]] = append(out[table][f[1]], args)
		case len(f) >= 4 && f[0] == "-I":
			pos, err := strconv.Atoi(f[2])
			if err != nil {
				return nil, fmt.Errorf("line %d: %q: %w", n+1, line, err)
			}
			args := strings.Join(f[3:], " ")
			if canon != nil {
				args = canon(args)
			}
			out.chain(table, f[1])
			l := out[table][f[1]]
			if pos < 1 || pos > len(l)+1 {
				return nil, fmt.Errorf("line %d: %q: index %d out of range", n+1, line, pos)
			}
			out[table][f[1]] = slices.Insert(l, pos-1, args)
		default:
			return nil, fmt.Errorf("line %d: not understood: %q", n+1, line)
		}
	}
	return out, nil
}

// CanonicalIPTables rewrites a rule's args (as Istio writes them) into the
// form iptables-save prints for the vocabulary of the sidecar rules: address,
// interface and protocol options first, the implicit tcp/udp match made
// explicit, numbers and target options as the kernel reports them. v6
// selects the IPv6 spelling of TPROXY's --on-ip.
func CanonicalIPTables(args string, v6 bool) string {
	tok := strings.Fields(args)
	var (
		ip      = map[string]string{} // -s -d -i -o -p -> "[! ]-x v"
		matches [][]string            // each: "-m", name, options...
		target  []string
		neg     bool
		proto   string
	)
	cur := -1 // index into matches of the module receiving options
	module := func(name string) {
		matches = append(matches, []string{"-m", name})
		cur = len(matches) - 1
	}
	opt := func(s ...string) {
		if neg {
			s = append([]string{"!"}, s...)
			neg = false
		}
		matches[cur] = append(matches[cur], s...)
	}
	for i := 0; i < len(tok); i++ {
		t := tok[i]
		next := func() string {
			i++
			if i < len(tok) {
				return tok[i]
			}
			return ""
		}
		switch t {
		case "!":
			neg = true
		case "-s", "-d", "-i", "-o", "-p":
			v := next()
			if t == "-p" {
				proto = v
			}
			if t == "-s" || t == "-d" {
				v = canonPrefix(v)
				if strings.HasSuffix(v, "/0") {
					neg = false
					continue
				}
			}
			s := t + " " + v
			if neg {
				s, neg = "! "+s, false
			}
			ip[t] = s
		case "-m":
			module(next())
		case "--dport", "--sport":
			if cur < 0 || (matches[cur][1] != "tcp" && matches[cur][1] != "udp") {
				module(proto)
			}
			opt(t, next())
		case "--mark":
			v := next()
			m, mask, hasMask := strings.Cut(v, "/")
			v = hexNum(m)
			if hasMask {
				v += "/" + hexNum(mask)
			}
			opt(t, v)
		case "-j":
			target = canonTarget(tok[i+1:], v6)
			i = len(tok)
		default:
			if strings.HasPrefix(t, "--") {
				opt(t, next())
			}
		}
	}
	var parts []string
	for _, k := range []string{"-s", "-d", "-i", "-o", "-p"} {
		if s, ok := ip[k]; ok {
			parts = append(parts, s)
		}
	}
	for _, m := range matches {
		parts = append(parts, m...)
	}
	parts = append(parts, target...)
	return strings.Join(parts, " ")
}

func canonTarget(tok []string, v6 bool) []string {
	if len(tok) == 0 {
		return nil
	}
	name, opts := tok[0], tok[1:]
	get := func(k string) string {
		for i := 0; i+1 < len(opts); i++ {
			if opts[i] == k {
				return opts[i+1]
			}
		}
		return ""
	}
	out := []string{"-j", name}
	switch name {
	case "REDIRECT":
		p := get("--to-ports")
		if p == "" {
			p = get("--to-port")
		}
		return append(out, "--to-ports", p)
	case "MARK":
		return append(out, "--set-xmark", hexNum(get("--set-mark"))+"/0xffffffff")
	case "CONNMARK":
		op := "--save-mark"
		if slices.Contains(opts, "--restore-mark") {
			op = "--restore-mark"
		}
		return append(out, op, "--nfmask", "0xffffffff", "--ctmask", "0xffffffff")
	case "TPROXY":
		m, mask, _ := strings.Cut(get("--tproxy-mark"), "/")
		onIP := "0.0.0.0"
		if v6 {
			onIP = "::"
		}
		return append(out, "--on-port", get("--on-port"), "--on-ip", onIP, "--tproxy-mark", hexNum(m)+"/"+hexNum(mask))
	}
	return append(out, opts...)
}

func hexNum(s string) string {
	v, err := strconv.ParseUint(s, 0, 32)
	if err != nil {
		return s
	}
	return "0x" + strconv.FormatUint(v, 16)
}

func canonPrefix(s string) string {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return s
		}
		return netip.PrefixFrom(a, a.BitLen()).String()
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return s
	}
	return p.Masked().String()
}

// NFT is an nft transaction replayed: table -> chain -> rules, plus each
// table's chains in creation order with their base-chain spec ("" for a
// regular chain).
type NFT struct {
	Rules  Chains
	Chains map[string][]string
	Spec   map[string]string // "table chain" -> "type nat hook output priority -100"
}

// ReplayNFT applies an nft -f transaction of the forms knftables writes
// (add table/chain/rule, flush table, insert rule ... index N: before the
// N-th rule, 0-based); canon rewrites each rule (nil: as written).
func ReplayNFT(text string, canon func(string) string) (NFT, error) {
	out := NFT{Rules: Chains{}, Chains: map[string][]string{}, Spec: map[string]string{}}
	for n, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) == 0:
		case len(f) >= 4 && (f[0] == "add" || f[0] == "flush") && f[1] == "table":
		case len(f) >= 5 && f[0] == "add" && f[1] == "chain":
			table, chain := f[3], f[4]
			out.Chains[table] = append(out.Chains[table], chain)
			if i := strings.Index(line, "{"); i >= 0 {
				spec := strings.Trim(strings.TrimSpace(line[i:]), "{} ;")
				out.Spec[table+" "+chain] = strings.Join(strings.Fields(strings.TrimSuffix(strings.TrimSpace(spec), ";")), " ")
			}
			out.Rules.chain(table, chain)
		case len(f) >= 6 && (f[0] == "add" || f[0] == "insert") && f[1] == "rule":
			table, chain := f[3], f[4]
			rest := f[5:]
			index := -1
			if len(rest) >= 2 && rest[0] == "index" {
				var err error
				if index, err = strconv.Atoi(rest[1]); err != nil {
					return out, fmt.Errorf("line %d: %q: %w", n+1, line, err)
				}
				rest = rest[2:]
			}
			r := strings.Join(rest, " ")
			if canon != nil {
				r = canon(r)
			}
			out.Rules.chain(table, chain)
			l := out.Rules[table][chain]
			switch {
			case f[0] == "add" && index < 0:
				l = append(l, r)
			case f[0] == "insert" && index < 0:
				l = slices.Insert(l, 0, r)
			case f[0] == "insert" && index <= len(l):
				l = slices.Insert(l, index, r)
			case f[0] == "add" && index < len(l):
				l = slices.Insert(l, index+1, r)
			default:
				return out, fmt.Errorf("line %d: %q: index out of range", n+1, line)
			}
			out.Rules[table][chain] = l
		default:
			return out, fmt.Errorf("line %d: not understood: %q", n+1, line)
		}
	}
	return out, nil
}

// CanonicalNFT rewrites a rule as Istio writes it (nft -f input) into the
// form `nft list` prints for the vocabulary of the sidecar rules: counters
// with their values, uid/gid and mark matches with their meta keyword and
// hex values, quoted interface names, full-length prefixes as addresses,
// and a protocol match dropped when a later port match implies it.
func CanonicalNFT(rule string) string {
	tok := strings.Fields(rule)
	var out []string
	for i := 0; i < len(tok); i++ {
		t := tok[i]
		peek := func(k int) string {
			if i+k < len(tok) {
				return tok[i+k]
			}
			return ""
		}
		switch {
		case t == "counter":
			out = append(out, "counter", "packets", "0", "bytes", "0")
		case t == "meta" && (peek(1) == "skuid" || peek(1) == "skgid"):
			// "meta skuid" written in full: the next token handles it.
		case t == "skuid" || t == "skgid":
			out = append(out, "meta", t)
		case t == "oifname" || t == "iifname":
			out = append(out, t)
			if peek(1) == "!=" {
				out = append(out, "!=")
				i++
			}
			i++
			out = append(out, strconv.Quote(strings.Trim(tok[i], `"`)))
		case (t == "ip" || t == "ip6") && (peek(1) == "saddr" || peek(1) == "daddr"):
			out = append(out, t, peek(1))
			i += 2
			if tok[i] == "!=" {
				out = append(out, "!=")
				i++
			}
			p := canonPrefix(tok[i])
			if pp, err := netip.ParsePrefix(p); err == nil && pp.Bits() == pp.Addr().BitLen() {
				p = pp.Addr().String()
			}
			out = append(out, p)
		case t == "mark" && (i == 0 || tok[i-1] != "set" && tok[i-1] != "ct" && tok[i-1] != "meta"):
			out = append(out, "meta", "mark")
			if peek(1) == "!=" {
				out = append(out, "!=")
				i++
			}
			i++
			out = append(out, hex8(tok[i]))
		case t == "meta" && peek(1) == "mark" && peek(2) == "set" && peek(3) != "ct":
			out = append(out, "meta", "mark", "set", hex8(peek(3)))
			i += 3
		case t == "ct" && peek(1) == "mark" && peek(2) == "set" && peek(3) == "mark":
			out = append(out, "ct", "mark", "set", "meta", "mark")
			i += 3
		case t == "ct" && peek(1) == "mark" && peek(2) != "set" && peek(2) != "":
			out = append(out, "ct", "mark", hex8(peek(2)))
			i += 2
		case t == "ct" && peek(1) == "state":
			states := strings.Split(peek(2), ",")
			order := []string{"invalid", "established", "related", "new", "untracked"}
			slices.SortFunc(states, func(a, b string) int { return slices.Index(order, a) - slices.Index(order, b) })
			out = append(out, "ct", "state", strings.Join(states, ","))
			i += 2
		case t == "meta" && peek(1) == "l4proto":
			proto := peek(2)
			i += 2
			implied := false
			for _, later := range tok[i+1:] {
				if later == proto {
					implied = true
				}
			}
			if !implied {
				out = append(out, "meta", "l4proto", proto)
			}
		default:
			out = append(out, t)
		}
	}
	return strings.Join(out, " ")
}

func hex8(s string) string {
	v, err := strconv.ParseUint(s, 0, 32)
	if err != nil {
		return s
	}
	return fmt.Sprintf("0x%08x", v)
}
