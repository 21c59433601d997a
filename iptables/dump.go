package iptables

import (
	"context"

	"github.com/containernetworking/plugins/pkg/ns"
)

// DumpPod returns the live rules of podNS as text, for `ambientd status
// --pod`: with an iptables backend what iptables-save prints per family
// (each headed by a comment naming the program), with the nftables backend
// what `nft list ruleset` prints (the nft program must exist). It changes
// nothing.
func (m *Manager) DumpPod(ctx context.Context, podNS ns.NetNS) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	var out string
	err := inNS(podNS, "dump pod rules", func() error {
		var err error
		out, err = m.be.Dump(ctx)
		return err
	})
	return out, err
}
