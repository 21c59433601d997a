package iptables

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

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
	var b strings.Builder
	err := inNS(podNS, "dump pod rules", func() error {
		switch be := m.be.(type) {
		case *xtables:
			fams := be.families()
			procs := make([]proc, len(fams))
			for i, f := range fams {
				procs[i] = be.saveProc(f)
			}
			outs, errs := be.runAll(ctx, procs)
			for i, f := range fams {
				if errs[i] != nil {
					return errs[i]
				}
				fmt.Fprintf(&b, "# %s (%s)\n%s", be.tools[f].save, f, outs[i])
			}
			return nil
		default:
			nft, err := exec.LookPath("nft")
			if err != nil {
				return fmt.Errorf("listing %s rules needs the nft program: %w", m.mode, err)
			}
			out, err := exec.CommandContext(ctx, nft, "list", "ruleset").CombinedOutput()
			if err != nil {
				return errors.Join(fmt.Errorf("nft list ruleset: %w", err), errors.New(strings.TrimSpace(string(out))))
			}
			fmt.Fprintf(&b, "# nft list ruleset\n%s", out)
			return nil
		}
	})
	return b.String(), err
}
