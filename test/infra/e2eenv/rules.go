package e2eenv

import (
	"bytes"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
)

// iptablesVariants are the tools of both iptables variants, both families.
var iptablesVariants = []string{"iptables-legacy", "iptables-nft", "ip6tables-legacy", "ip6tables-nft"}

// WipeRules flushes and deletes every chain of the nat, mangle and raw
// tables in the pod's netns, with every iptables variant present (IPv4 and
// IPv6): what a sandbox recreated without our plugin, or a NET_ADMIN
// container flushing its tables, leaves behind.
func (p *Pod) WipeRules() error {
	for _, tool := range iptablesVariants {
		if _, err := exec.LookPath(tool); err != nil {
			continue
		}
		for _, table := range []string{"nat", "mangle", "raw"} {
			for _, op := range []string{"-F", "-X"} {
				var buf bytes.Buffer
				err := p.Do(func() error {
					cmd := exec.Command(tool, "-w", "-t", table, op)
					cmd.Stdout, cmd.Stderr = &buf, &buf
					return cmd.Run()
				})
				if err != nil {
					return fmt.Errorf("%s -t %s %s in pod %s/%s: %w: %s", tool, table, op, p.Namespace, p.Name, err, buf.String())
				}
			}
		}
	}
	return nil
}

var ruleCounters = regexp.MustCompile(`\[\d+:\d+\]`)

// Rules returns our rules inside the pod's netns: iptables-save of both
// variants, only the lines naming the ISTIO_ chains, each prefixed with the
// tool, counters stripped.
func (p *Pod) Rules() (string, error) {
	var out []string
	for _, tool := range []string{"iptables-legacy-save", "iptables-nft-save"} {
		if _, err := exec.LookPath(tool); err != nil {
			continue
		}
		var buf bytes.Buffer
		err := p.Do(func() error {
			cmd := exec.Command(tool)
			cmd.Stdout, cmd.Stderr = &buf, &buf
			return cmd.Run()
		})
		if err != nil {
			return "", fmt.Errorf("%s in pod %s/%s: %w: %s", tool, p.Namespace, p.Name, err, buf.String())
		}
		for _, l := range strings.Split(buf.String(), "\n") {
			if strings.Contains(l, "ISTIO_") && !strings.HasPrefix(l, "#") {
				out = append(out, tool+": "+ruleCounters.ReplaceAllString(l, ""))
			}
		}
	}
	return strings.Join(out, "\n"), nil
}
