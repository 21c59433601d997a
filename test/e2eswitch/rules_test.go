//go:build e2enode

package e2eswitch

import (
	"bufio"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// The three places capture rules can live in a pod's network namespace.
const (
	backendLegacy   = "iptables-legacy"
	backendNFT      = "iptables-nft"
	backendNFTables = "nftables"
)

// jumps counts, per backend, the jumps from each built-in chain into the
// capture chains inside the pod netns at path: "-A PREROUTING -j ISTIO_PRERT"
// and "-A OUTPUT -j ISTIO_OUTPUT" per family and table in iptables-legacy and
// iptables-nft, "jump istio-prerouting" / "jump istio-output" from the base
// chains of the inet istio-ambient-* tables in nftables. Keys of the inner map
// name the built-in chain, e.g. "ipv6 nat OUTPUT" or "istio-ambient-nat
// output". Only reads: the save tools run without -t (iptables-legacy-save -t
// would create the table it names).
type jumps map[string]map[string]int

func readJumps(ctx context.Context, netnsPath string) (jumps, error) {
	name := filepath.Base(netnsPath)
	out := jumps{}
	for _, x := range []struct{ backend, family, tool string }{
		{backendLegacy, "ipv4", "iptables-legacy-save"},
		{backendLegacy, "ipv6", "ip6tables-legacy-save"},
		{backendNFT, "ipv4", "iptables-nft-save"},
		{backendNFT, "ipv6", "ip6tables-nft-save"},
	} {
		text, err := inNetns(ctx, name, x.tool)
		if err != nil {
			return nil, err
		}
		table := ""
		for _, line := range strings.Split(text, "\n") {
			line = strings.TrimSpace(line)
			switch {
			case strings.HasPrefix(line, "*"):
				table = line[1:]
			case line == "-A PREROUTING -j ISTIO_PRERT" || line == "-A OUTPUT -j ISTIO_OUTPUT":
				out.add(x.backend, fmt.Sprintf("%s %s %s", x.family, table, strings.Fields(line)[1]))
			}
		}
	}
	text, err := inNetns(ctx, name, "nft", "list", "ruleset")
	if err != nil {
		return nil, err
	}
	table, chain := "", ""
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[0] == "table":
			table = ""
			if f[1] == "inet" && strings.HasPrefix(f[2], "istio-ambient-") {
				table = f[2]
			}
		case len(f) >= 2 && f[0] == "chain":
			chain = f[1]
		case table != "" && (chain == "prerouting" || chain == "output") && slices.Contains(f, "jump"):
			out.add(backendNFTables, table+" "+chain)
		}
	}
	return out, nil
}

func (j jumps) add(backend, from string) {
	if j[backend] == nil {
		j[backend] = map[string]int{}
	}
	j[backend][from]++
}

// backends lists the backends holding any jump, sorted.
func (j jumps) backends() []string {
	var out []string
	for b, m := range j {
		if len(m) > 0 {
			out = append(out, b)
		}
	}
	slices.Sort(out)
	return out
}

// oneSet reports whether exactly one backend holds capture jumps and none of
// its built-in chains jumps twice; it returns that backend.
func (j jumps) oneSet() (string, error) {
	bs := j.backends()
	if len(bs) != 1 {
		return "", fmt.Errorf("capture jumps in %d backends %v, want exactly one: %s", len(bs), bs, j)
	}
	for from, n := range j[bs[0]] {
		if n != 1 {
			return bs[0], fmt.Errorf("%s: %d jumps from %s, want 1: %s", bs[0], n, from, j)
		}
	}
	return bs[0], nil
}

func (j jumps) String() string {
	var parts []string
	for _, b := range []string{backendLegacy, backendNFT, backendNFTables} {
		total := 0
		for _, n := range j[b] {
			total += n
		}
		parts = append(parts, fmt.Sprintf("%s=%d", b, total))
	}
	return strings.Join(parts, " ")
}

// inNetns runs a program in the named netns (in /run/netns, where
// containerd puts the pods') and returns its output.
func inNetns(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", name}, args...)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("ip netns exec %s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}
