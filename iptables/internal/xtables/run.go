package xtables

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// Tools are the resolved save and restore programs of one family and
// variant.
type Tools struct {
	Save, Restore string
}

// LookTools resolves the variant's (legacy or nft) save and restore programs
// of family f on PATH, /usr/sbin or /sbin.
func LookTools(f rules.Family, variant rules.Mode) (Tools, error) {
	base := "iptables"
	if f == rules.IPv6 {
		base = "ip6tables"
	}
	var t Tools
	var err error
	if t.Save, err = lookPath(fmt.Sprintf("%s-%s-save", base, variant)); err != nil {
		return t, err
	}
	if t.Restore, err = lookPath(fmt.Sprintf("%s-%s-restore", base, variant)); err != nil {
		return t, err
	}
	return t, nil
}

func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		if p, err := exec.LookPath(dir + "/" + name); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH, /usr/sbin or /sbin", name)
}

// proc is one iptables-save or iptables-restore invocation.
type proc struct {
	path  string
	stdin []byte
	args  []string
}

func (b *Backend) restoreProc(f rules.Family, batch string) proc {
	return proc{path: b.tools[f].Restore, stdin: []byte(batch),
		args: []string{"--noflush", "--wait=" + strconv.Itoa(max(1, int((b.cfg.LockWait+time.Second-1)/time.Second)))}}
}

func (b *Backend) saveProc(f rules.Family) proc { return proc{path: b.tools[f].Save} }

// runAll starts every process from the calling goroutine, so on a thread
// locked into a namespace each child inherits that namespace, lets them run
// side by side (IPv4 and IPv6 at once) and waits for all. Bounded by ctx and
// cfg.Timeout.
func (b *Backend) runAll(ctx context.Context, procs []proc) ([]string, []error) {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.Timeout)
	defer cancel()
	outs := make([]string, len(procs))
	errs := make([]error, len(procs))
	cmds := make([]*exec.Cmd, len(procs))
	stdouts := make([]bytes.Buffer, len(procs))
	stderrs := make([]bytes.Buffer, len(procs))
	for i, p := range procs {
		cmd := exec.CommandContext(ctx, p.path, p.args...)
		cmd.Stdout, cmd.Stderr = &stdouts[i], &stderrs[i]
		if p.stdin != nil {
			cmd.Stdin = bytes.NewReader(p.stdin)
		}
		cmd.WaitDelay = time.Second
		b.spawned.Add(1)
		if err := cmd.Start(); err != nil {
			errs[i] = fmt.Errorf("starting %s: %w", p.path, err)
			continue
		}
		cmds[i] = cmd
	}
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		if err := cmd.Wait(); err != nil {
			errs[i] = fmt.Errorf("%s %s: %w: %s", procs[i].path, strings.Join(procs[i].args, " "), err, strings.TrimSpace(stderrs[i].String()))
		}
		outs[i] = stdouts[i].String()
	}
	return outs, errs
}

// saveAll reads the state of the given families, one save each, concurrently.
func (b *Backend) saveAll(ctx context.Context, fams []rules.Family) (map[rules.Family]saveState, error) {
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = b.saveProc(f)
	}
	outs, errs := b.runAll(ctx, procs)
	states := map[rules.Family]saveState{}
	for i, f := range fams {
		if errs[i] != nil {
			return nil, errs[i]
		}
		st, err := parseSave(outs[i])
		if err != nil {
			return nil, fmt.Errorf("%s: %w", b.tools[f].Save, err)
		}
		states[f] = st
	}
	return states, nil
}

// CountRules returns how many rules the variant's save of family f prints in
// the current namespace (one save): auto detection follows the variant
// kubelet and kube-proxy already use.
func CountRules(ctx context.Context, cfg Config, variant rules.Mode, f rules.Family) (int, error) {
	t, err := LookTools(f, variant)
	if err != nil {
		return 0, err
	}
	cfg = cfg.withDefaults()
	b := &Backend{cfg: cfg, mode: variant, tools: map[rules.Family]Tools{f: t}, spawned: cfg.Spawned}
	outs, errs := b.runAll(ctx, []proc{b.saveProc(f)})
	if errs[0] != nil {
		return 0, errs[0]
	}
	return strings.Count(outs[0], "\n-A "), nil
}

// Dump returns what iptables-save prints per family, each headed by a
// comment naming the program. It changes nothing.
func (b *Backend) Dump(ctx context.Context) (string, error) {
	fams := b.Families()
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = b.saveProc(f)
	}
	outs, errs := b.runAll(ctx, procs)
	var s strings.Builder
	for i, f := range fams {
		if errs[i] != nil {
			return s.String(), errs[i]
		}
		fmt.Fprintf(&s, "# %s (%s)\n%s", b.tools[f].Save, f, outs[i])
	}
	return s.String(), nil
}
