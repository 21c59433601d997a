package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/nftables"
)

// tools are the resolved save/restore programs of one family.
type tools struct {
	save, restore string
}

// xtables is the iptables-restore backend of one variant (legacy or nft):
// one restore batch per family per operation, read back with one save.
type xtables struct {
	cfg     Config
	log     *slog.Logger
	mode    Mode
	tools   map[Family]tools
	spawned *atomic.Int64
	// bg counts netlink sockets released in the background.
	bg *sync.WaitGroup
}

// newXtables resolves the variant's programs for fams; a family whose tools
// are missing is an error.
func newXtables(cfg Config, log *slog.Logger, mode Mode, spawned *atomic.Int64, bg *sync.WaitGroup, fams []Family) (*xtables, error) {
	x := &xtables{cfg: cfg, log: log, mode: mode, tools: map[Family]tools{}, spawned: spawned, bg: bg}
	for _, f := range fams {
		t, err := lookTools(f, mode)
		if err != nil {
			return nil, err
		}
		x.tools[f] = t
	}
	return x, nil
}

func (x *xtables) name() Mode { return x.mode }

func (x *xtables) families() []Family {
	if x.cfg.IPv6 {
		return []Family{IPv4, IPv6}
	}
	return []Family{IPv4}
}

func lookTools(f Family, mode Mode) (tools, error) {
	base := "iptables"
	if f == IPv6 {
		base = "ip6tables"
	}
	var t tools
	var err error
	if t.save, err = lookPath(fmt.Sprintf("%s-%s-save", base, mode)); err != nil {
		return t, err
	}
	if t.restore, err = lookPath(fmt.Sprintf("%s-%s-restore", base, mode)); err != nil {
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

func (x *xtables) restoreProc(f Family, batch string) proc {
	return proc{path: x.tools[f].restore, stdin: []byte(batch),
		args: []string{"--noflush", "--wait=" + strconv.Itoa(max(1, int((x.cfg.LockWait+time.Second-1)/time.Second)))}}
}

func (x *xtables) saveProc(f Family) proc { return proc{path: x.tools[f].save} }

// run runs one program; see runAll.
func (x *xtables) run(ctx context.Context, path string, stdin []byte, args ...string) (string, error) {
	outs, errs := x.runAll(ctx, []proc{{path: path, stdin: stdin, args: args}})
	return outs[0], errs[0]
}

// runAll starts every process from the calling goroutine, so on a thread
// locked into a namespace each child inherits that namespace, lets them run
// side by side (IPv4 and IPv6 at once) and waits for all. Bounded by ctx and
// cfg.Timeout.
func (x *xtables) runAll(ctx context.Context, procs []proc) ([]string, []error) {
	ctx, cancel := context.WithTimeout(ctx, x.cfg.Timeout)
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
		x.spawned.Add(1)
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
func (x *xtables) saveAll(ctx context.Context, fams []Family) (map[Family]saveState, error) {
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = x.saveProc(f)
	}
	outs, errs := x.runAll(ctx, procs)
	states := map[Family]saveState{}
	for i, f := range fams {
		if errs[i] != nil {
			return nil, errs[i]
		}
		st, err := parseSave(outs[i])
		if err != nil {
			return nil, fmt.Errorf("%s: %w", x.tools[f].save, err)
		}
		states[f] = st
	}
	return states, nil
}

// converge runs one optimistic batch per family (all families at once); for
// the families where it fails as a whole, it reads the state (one save) and
// runs the batch fix renders from it, unless that is empty.
func (x *xtables) converge(ctx context.Context, what string, fams []Family, first func(Family) string, fix func(Family, saveState) string) error {
	procs := make([]proc, len(fams))
	for i, f := range fams {
		procs[i] = x.restoreProc(f, first(f))
	}
	_, errs := x.runAll(ctx, procs)
	var failed []Family
	firstErr := map[Family]error{}
	for i, f := range fams {
		if errs[i] != nil {
			failed = append(failed, f)
			firstErr[f] = errs[i]
		}
	}
	if len(failed) == 0 {
		return nil
	}
	states, err := x.saveAll(ctx, failed)
	if err != nil {
		return fmt.Errorf("%s: batch failed (%v), then reading the state failed: %w", what, errors.Join(errs...), err)
	}
	procs, fams = procs[:0], fams[:0:0]
	for _, f := range failed {
		x.log.Debug("iptables batch fell back to state-based repair", "op", what, "family", f.String(), "first_error", firstErr[f])
		if batch := fix(f, states[f]); batch != "" {
			procs = append(procs, x.restoreProc(f, batch))
			fams = append(fams, f)
		}
	}
	_, errs = x.runAll(ctx, procs)
	for i, err := range errs {
		if err != nil {
			return fmt.Errorf("%s %s: %w", what, fams[i], err)
		}
	}
	return nil
}

// apply installs rs in the current namespace. The common case, a namespace
// without our chains, costs one restore per family. Otherwise the state is
// read (one save) and, only if it differs, repaired (one restore).
func (x *xtables) apply(ctx context.Context, rs RuleSet) error {
	return x.converge(ctx, "apply", rs.Families(), rs.RenderApply, rs.renderRepair)
}

// remove deletes rs's chains and jumps from the current namespace: one
// restore per family when all are present, else one save plus, if anything
// of ours is left, one restore.
func (x *xtables) remove(ctx context.Context, rs RuleSet) error {
	return x.converge(ctx, "delete", rs.Families(), rs.RenderDelete,
		func(_ Family, st saveState) string { return rs.renderDeleteFrom(st) })
}

// verify reads the state (one save per family) and diffs it against rs.
func (x *xtables) verify(ctx context.Context, rs RuleSet) (Drift, error) {
	states, err := x.saveAll(ctx, rs.Families())
	if err != nil {
		return Drift{}, err
	}
	var d Drift
	for _, f := range rs.Families() {
		d.add(rs.diff(f, states[f]))
	}
	return d, nil
}

// --- backend ------------------------------------------------------------

func (x *xtables) applyPod(ctx context.Context, opts PodOptions, _ *nsView) error {
	return x.apply(ctx, BuildPodRules(x.cfg, opts))
}

func (x *xtables) verifyPod(ctx context.Context, opts PodOptions, _ *nsView) (Drift, error) {
	return x.verify(ctx, BuildPodRules(x.cfg, opts))
}

func (x *xtables) deletePod(ctx context.Context, _ *nsView) error {
	return errors.Join(x.remove(ctx, BuildPodRules(x.cfg, PodOptions{})), x.removeForeignV6(ctx))
}

// removeForeignV6 removes our IPv6 chains from a dual-stack pod when IPv6 is
// off: they can only have been put there by someone else (Istio's agent, whose
// pods we adopt, or ambientd run with --ipv6), and left in place they would
// keep sending the pod's IPv6 connections to a ztunnel that no longer serves
// it. IPv4-only pods (no global IPv6 address) cost nothing: no process runs.
func (x *xtables) removeForeignV6(ctx context.Context) error {
	if _, ok := x.tools[IPv6]; x.cfg.IPv6 || !ok {
		return nil
	}
	has, err := hasGlobalIPv6()
	if err != nil || !has {
		return err
	}
	cfg := x.cfg
	cfg.IPv6 = true
	rs := BuildPodRules(cfg, PodOptions{})
	return x.converge(ctx, "delete", []Family{IPv6}, rs.RenderDelete,
		func(_ Family, st saveState) string { return rs.renderDeleteFrom(st) })
}

// holds reports whether any of chains exists in this variant's tables of
// the families we have tools for. iptables-nft is read over netlink (no
// process); legacy only runs a save when the kernel lists legacy tables in
// this namespace at all (someone used iptables-legacy here).
func (x *xtables) holds(ctx context.Context, v *nsView, chains ...string) (bool, error) {
	var fams []Family
	for f := range x.tools {
		fams = append(fams, f)
	}
	if x.mode == ModeNFT {
		if v != nil {
			var nf []nftables.TableFamily
			for _, f := range fams {
				nf = append(nf, nftFamily(f))
			}
			return v.has(nf, nil, chains), nil
		}
		return iptablesNFTChains(x.bg, fams, chains...)
	}
	var used []Family
	for _, f := range fams {
		ok, err := legacyTablesUsed(f)
		if err != nil {
			return false, err
		}
		if ok {
			used = append(used, f)
		}
	}
	if len(used) == 0 {
		return false, nil
	}
	states, err := x.saveAll(ctx, used)
	if err != nil {
		return false, err
	}
	for _, st := range states {
		for _, ts := range st {
			for _, c := range chains {
				if ts.chains[c] {
					return true, nil
				}
			}
		}
	}
	return false, nil
}

func (x *xtables) holdsPod(ctx context.Context, v *nsView) (bool, error) {
	return x.holds(ctx, v, ChainPrerouting, ChainOutput)
}

// legacyTablesUsed reports whether the kernel has any legacy iptables table
// of f in the calling thread's namespace (thread-self: the thread may be
// inside a pod's namespace while the process is not).
func legacyTablesUsed(f Family) (bool, error) {
	name := "/proc/thread-self/net/ip_tables_names"
	if f == IPv6 {
		name = "/proc/thread-self/net/ip6_tables_names"
	}
	b, err := os.ReadFile(name)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil // module not loaded: no legacy tables anywhere
	}
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", name, err)
	}
	return strings.TrimSpace(string(b)) != "", nil
}
