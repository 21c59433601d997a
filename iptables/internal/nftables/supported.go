package nftables

import (
	"os"
	"strconv"

	nft "github.com/google/nftables"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Supported checks, with one transaction that creates and deletes a scratch
// table (the commit nets out to nothing), that the kernel accepts what our
// rules need in the current namespace: inet nat chains, redirect, conntrack
// mark and zone, a set lookup and SNAT.
func Supported() error {
	c, err := dial(nil)
	if err != nil {
		return err
	}
	defer c.close()
	name := "ambientd-probe-" + strconv.Itoa(os.Getpid())
	tx := c.begin()
	tx.addTable(name)
	tx.addSet(name, Set{Name: rules.ProbeSetV4}, 1)
	tx.addChain(name, Chain{Name: "post", Type: nft.ChainTypeNAT, Hook: nft.ChainHookPostrouting, Priority: nftPrioritySrcNAT})
	tx.addChain(name, Chain{Name: "out", Type: nft.ChainTypeNAT, Hook: nft.ChainHookOutput, Priority: nftPriorityDstNAT})
	for _, r := range []Rule{
		{Chain: "out", stmts: []statement{port("tcp", "dport", true, 1), mark(true, rules.ProxyMark), counter(), redirect(rules.OutboundPort)}},
		{Chain: "out", stmts: []statement{ctmark(rules.ConnMark), restoreMark()}},
		{Chain: "out", stmts: []statement{setConnmark(), ctZone(1)}},
		{Chain: "post", stmts: []statement{skuid(0), inSet(rules.IPv4, rules.ProbeSetV4), snatTo(rules.ProbeSNATv4)}},
	} {
		tx.addRule(name, r)
	}
	tx.delTable(name)
	return tx.commit()
}
