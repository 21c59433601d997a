package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"regexp"
	"strings"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// The native nftables backend's layout (Istio's, docs/rules.md): the pod's
// rules in the inet tables below, the base chains prerouting and output
// jumping to istio-prerouting and istio-output; the node's probe SNAT in
// the nat table's postrouting chain. The soak wipes them as a firewall
// reload or a NET_ADMIN container would, whichever backend the agent runs.
const nftNat = "istio-ambient-nat"

var nftPodTables = []string{nftNat, "istio-ambient-mangle", "istio-ambient-raw"}

// nft runs nft with args in the current network namespace.
func nft(args ...string) (string, error) {
	var buf bytes.Buffer
	cmd := exec.Command("nft", args...)
	cmd.Stdout, cmd.Stderr = &buf, &buf
	err := cmd.Run()
	if err != nil {
		return buf.String(), fmt.Errorf("nft %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(buf.String()))
	}
	return buf.String(), nil
}

// missing: nft failed because the table or chain is not there (the other
// backend runs, or an earlier fault removed it, not yet repaired).
func missing(err error) bool {
	return err != nil && strings.Contains(err.Error(), "No such file or directory")
}

var nftHandle = regexp.MustCompile(`# handle (\d+)$`)

// deleteNFTRule deletes, in the current network namespace, the first rule
// of inet table/chain whose text contains match; found is false when
// there is none (or no such chain).
func deleteNFTRule(table, chain, match string) (found bool, err error) {
	out, err := nft("-a", "list", "chain", "inet", table, chain)
	if missing(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	for _, l := range strings.Split(out, "\n") {
		m := nftHandle.FindStringSubmatch(strings.TrimSpace(l))
		if m == nil || !strings.Contains(l, match) {
			continue
		}
		_, err := nft("delete", "rule", "inet", table, chain, "handle", m[1])
		if missing(err) {
			return false, nil
		}
		return err == nil, err
	}
	return false, nil
}

// wipePodRules removes the pod's rules in every backend: every nat, mangle
// and raw table of both iptables variants flushed, and the native tables
// deleted.
func wipePodRules(p *e2eenv.Pod) error {
	if err := p.WipeRules(); err != nil {
		return err
	}
	return p.Do(func() error {
		for _, t := range nftPodTables {
			if _, err := nft("delete", "table", "inet", t); err != nil && !missing(err) {
				return fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err)
			}
		}
		return nil
	})
}

// dropPodJump deletes one rule in the pod: the nat table's jump to the
// inbound (prerouting) or the outbound (output) capture chain, in the
// native tables or, when they are not there, in iptables-nft. One
// direction of the pod then reaches its far end directly: partial drift,
// which only a rule-by-rule comparison finds. It returns what it deleted.
func dropPodJump(p *e2eenv.Pod, rng *rand.Rand) (string, error) {
	hook, nftChain, ipt, iptChain := "prerouting", "istio-prerouting", "PREROUTING", "ISTIO_PRERT"
	if rng.IntN(2) == 0 {
		hook, nftChain, ipt, iptChain = "output", "istio-output", "OUTPUT", "ISTIO_OUTPUT"
	}
	var what string
	err := p.Do(func() error {
		found, err := deleteNFTRule(nftNat, hook, "jump "+nftChain)
		if err != nil || found {
			what = "nft " + hook + " jump " + nftChain
			return err
		}
		what = "iptables-nft nat " + ipt + " -j " + iptChain
		var buf bytes.Buffer
		cmd := exec.Command("iptables-nft", "-w", "-t", "nat", "-D", ipt, "-j", iptChain)
		cmd.Stdout, cmd.Stderr = &buf, &buf
		// Missing (wiped by an earlier fault, not yet repaired) is fine.
		if err := cmd.Run(); err != nil && !strings.Contains(buf.String(), "does a matching rule exist") && !strings.Contains(buf.String(), "does not exist") {
			return fmt.Errorf("%s: %w: %s", what, err, strings.TrimSpace(buf.String()))
		}
		return nil
	})
	return what, err
}

// deleteHostRules removes the node's probe SNAT as a firewall reload does:
// in iptables-nft the POSTROUTING jump and the ISTIO_POSTRT chain's rules;
// in native nftables the whole nat table (its probe sets too) or, one time
// in two, only the SNAT rule. Rules already missing are fine.
func deleteHostRules(ctx context.Context, rng *rand.Rand) (string, error) {
	for _, args := range [][]string{
		{"-w", "-t", "nat", "-D", "POSTROUTING", "-j", "ISTIO_POSTRT"},
		{"-w", "-t", "nat", "-F", "ISTIO_POSTRT"},
	} {
		_ = exec.CommandContext(ctx, "iptables-nft", args...).Run()
	}
	if rng.IntN(2) == 0 {
		_, err := nft("delete", "table", "inet", nftNat)
		if missing(err) {
			err = nil
		}
		return "nft table " + nftNat, err
	}
	_, err := deleteNFTRule(nftNat, "postrouting", "snat")
	return "nft postrouting snat rule", err
}

var nftCounters = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// hostRules is the node's rules of ours, counters stripped: the nat rules
// naming ISTIO_ chains in iptables-nft (iptables-nft-save), and the native
// nat table's postrouting chain.
func hostRules() string {
	var keep []string
	if out, err := exec.Command("iptables-nft-save", "-t", "nat").CombinedOutput(); err != nil {
		keep = append(keep, "iptables-nft-save: "+err.Error())
	} else {
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, "ISTIO_") && !strings.HasPrefix(l, "#") && !strings.HasPrefix(l, ":") {
				keep = append(keep, l)
			}
		}
	}
	if out, err := nft("list", "chain", "inet", nftNat, "postrouting"); err == nil {
		for _, l := range strings.Split(out, "\n") {
			if l = strings.TrimSpace(l); l != "" {
				keep = append(keep, "nft "+nftCounters.ReplaceAllString(l, "counter"))
			}
		}
	} else if !missing(err) {
		keep = append(keep, err.Error())
	}
	return strings.Join(keep, "\n")
}
