package iptables

import (
	"context"
	"fmt"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
)

// DumpPod returns the live rules of podNS as iptables-save prints them, one
// save per family this manager programs, each headed by a comment naming the
// program. It changes nothing (for `ambientd status --pod`).
func (m *Manager) DumpPod(ctx context.Context, podNS ns.NetNS) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	fams := m.families()
	var b strings.Builder
	err := inNS(podNS, "dump pod rules", func() error {
		procs := make([]proc, len(fams))
		for i, f := range fams {
			procs[i] = m.saveProc(f)
		}
		outs, errs := m.runAll(ctx, procs)
		for i, f := range fams {
			if errs[i] != nil {
				return errs[i]
			}
			fmt.Fprintf(&b, "# %s (%s)\n%s", m.tools[f].save, f, outs[i])
		}
		return nil
	})
	return b.String(), err
}
