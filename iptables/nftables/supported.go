package nftables

import (
	"fmt"
	"os"
	"strconv"

	nft "github.com/google/nftables"

	"github.com/ambientd/ambientd/iptables/rules"
)

// Supported checks, with one transaction that creates and deletes a scratch
// table (the commit nets out to nothing), that the kernel accepts what our
// rules need in the current namespace: inet nat chains, redirect, conntrack
// mark and zone, a set lookup and SNAT.
func Supported() error {
	c, err := nft.New(nft.AsLasting())
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer c.CloseLasting()
	t := c.AddTable(&nft.Table{Name: "ambientd-probe-" + strconv.Itoa(os.Getpid()), Family: inet})
	set := probeNFTSet(t, false)
	if err := c.AddSet(set, nil); err != nil {
		return err
	}
	prio := nft.ChainPriority(nftPrioritySrcNAT)
	post := c.AddChain(&nft.Chain{Name: "post", Table: t, Type: nft.ChainTypeNAT, Hooknum: nft.ChainHookPostrouting, Priority: &prio})
	out := c.AddChain(&nft.Chain{Name: "out", Table: t, Type: nft.ChainTypeNAT, Hooknum: nft.ChainHookOutput, Priority: nft.ChainPriorityNATDest})
	for _, r := range []struct {
		chain *nft.Chain
		stmts []statement
	}{
		{out, []statement{port("tcp", "dport", true, 1), mark(true, rules.ProxyMark), counter(), redirect(rules.OutboundPort)}},
		{out, []statement{ctmark(rules.ConnMark), restoreMark()}},
		{out, []statement{setConnmark(), ctZone(1)}},
		{post, []statement{skuid(0), inSet(rules.IPv4, rules.ProbeSetV4), snatTo(rules.ProbeSNATv4)}},
	} {
		c.AddRule(&nft.Rule{Table: t, Chain: r.chain, Exprs: Rule{stmts: r.stmts}.exprs()})
	}
	c.DelTable(t)
	return c.Flush()
}
