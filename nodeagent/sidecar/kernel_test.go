package sidecar_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/sidecar"
	"github.com/ambientd/ambientd/test/infra/istiogolden"
	"github.com/ambientd/ambientd/test/infra/testutil"
)

var allModes = []iptables.Mode{iptables.ModeLegacy, iptables.ModeNFT, iptables.ModeNFTables}

func testCtx(t testing.TB) context.Context { return testutil.Context(t, 3*time.Minute) }

func newManager(t testing.TB, mode iptables.Mode) *iptables.Manager {
	t.Helper()
	m, err := iptables.NewManager(testCtx(t), iptables.Config{Mode: mode, IPv6: true},
		slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		t.Fatalf("NewManager(%s): %v", mode, err)
	}
	t.Cleanup(m.WaitIdle)
	return m
}

// nsRun runs a program inside n (stdin optional) and returns its stdout.
func nsRun(t testing.TB, n ns.NetNS, stdin, name string, args ...string) string {
	t.Helper()
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		if stdin != "" {
			cmd.Stdin = strings.NewReader(stdin)
		}
		var err error
		out, err = cmd.Output()
		if ee, ok := err.(*exec.ExitError); ok {
			return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, ee.Stderr)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func tool(f iptables.Family, mode iptables.Mode, what string) string {
	return fmt.Sprintf("%s-%s-%s", f, mode, what)
}

// loadIstio programs Istio's golden rules into n the way Istio's plugin
// does (iptables-restore --noflush per family, or nft -f), and its netlink
// state as routes.txt records it.
func loadIstio(t *testing.T, n ns.NetNS, c istiogolden.Case, mode iptables.Mode) {
	t.Helper()
	if mode == iptables.ModeNFTables {
		nsRun(t, n, c.NFT, "nft", "-f", "-")
	} else {
		nsRun(t, n, c.IPTables4, tool(iptables.IPv4, mode, "restore"), "--noflush")
		if c.IPTables6 != "" {
			nsRun(t, n, c.IPTables6, tool(iptables.IPv6, mode, "restore"), "--noflush")
		}
	}
	err := n.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		for _, l := range strings.Split(strings.TrimSpace(c.Routes), "\n") {
			f := strings.Fields(l)
			switch {
			case len(f) == 0:
			case f[0] == "addr":
				a, err := netlink.ParseAddr(f[2])
				if err != nil {
					return err
				}
				if err := netlink.AddrAdd(lo, a); err != nil {
					return fmt.Errorf("%s: %w", l, err)
				}
			case f[0] == "rule":
				r := netlink.NewRule()
				r.Family = famOf(f[1])
				r.Priority, _ = strconv.Atoi(f[3])
				mark, mask, _ := strings.Cut(f[5], "/")
				m, _ := strconv.ParseUint(mark, 0, 32)
				k, _ := strconv.ParseUint(mask, 0, 32)
				r.Mark = uint32(m)
				km := uint32(k)
				r.Mask = &km
				r.Table, _ = strconv.Atoi(f[7])
				if err := netlink.RuleAdd(r); err != nil {
					return fmt.Errorf("%s: %w", l, err)
				}
			case f[0] == "route":
				_, dst, err := net.ParseCIDR(f[5])
				if err != nil {
					return err
				}
				scope := netlink.SCOPE_HOST
				if f[9] == "universe" {
					scope = netlink.SCOPE_UNIVERSE
				}
				table, _ := strconv.Atoi(f[11])
				if err := netlink.RouteAdd(&netlink.Route{Family: famOf(f[1]), LinkIndex: lo.Attrs().Index, Dst: dst,
					Type: unix.RTN_LOCAL, Scope: scope, Table: table}); err != nil {
					return fmt.Errorf("%s: %w", l, err)
				}
			default:
				return fmt.Errorf("routes.txt: %q not understood", l)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func famOf(s string) int {
	if s == "inet6" {
		return netlink.FAMILY_V6
	}
	return netlink.FAMILY_V4
}

// netState is n's policy rules, extra routes and lo addresses in the format
// of the oracle's routes.txt (beyond a fresh namespace's).
func netState(t *testing.T, n ns.NetNS) string {
	t.Helper()
	var out []string
	err := n.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
			name := map[int]string{netlink.FAMILY_V4: "inet", netlink.FAMILY_V6: "inet6"}[fam]
			rules, err := netlink.RuleList(fam)
			if err != nil {
				return err
			}
			for _, r := range rules {
				if r.Table == unix.RT_TABLE_MAIN || r.Table == unix.RT_TABLE_LOCAL || r.Table == unix.RT_TABLE_DEFAULT {
					continue
				}
				mask := ""
				if r.Mask != nil {
					mask = fmt.Sprintf("/%#x", *r.Mask)
				}
				out = append(out, fmt.Sprintf("rule %s priority %d fwmark %#x%s lookup %d", name, r.Priority, r.Mark, mask, r.Table))
			}
			routes, err := netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
			if err != nil {
				return err
			}
			for _, r := range routes {
				if r.Table == unix.RT_TABLE_MAIN || r.Table == unix.RT_TABLE_LOCAL || r.Table == unix.RT_TABLE_DEFAULT {
					continue
				}
				typ := fmt.Sprint(r.Type)
				if r.Type == unix.RTN_LOCAL {
					typ = "local"
				}
				out = append(out, fmt.Sprintf("route %s type %s dst %s dev lo scope %s table %d", name, typ, r.Dst, r.Scope, r.Table))
			}
			addrs, err := netlink.AddrList(lo, fam)
			if err != nil {
				return err
			}
			for _, a := range addrs {
				if a.IP.IsLoopback() {
					continue
				}
				out = append(out, fmt.Sprintf("addr %s %s dev lo", name, a.IPNet))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	if len(out) == 0 {
		return ""
	}
	return strings.Join(out, "\n") + "\n"
}

// listing is what the kernel holds of the sidecar rules in n: per family
// iptables-save parsed into chains (declared chains as a set, rules in
// order), or `nft list table` of each sidecar table that exists.
func listing(t *testing.T, n ns.NetNS, mode iptables.Mode) string {
	t.Helper()
	if mode == iptables.ModeNFTables {
		tables := nsRun(t, n, "", "nft", "list", "tables")
		var b strings.Builder
		for _, tbl := range []string{iptables.NFTTableSidecarNat, iptables.NFTTableSidecarMangle, iptables.NFTTableSidecarRaw} {
			if strings.Contains(tables, "inet "+tbl+"\n") {
				b.WriteString(nsRun(t, n, "", "nft", "list", "table", "inet", tbl))
			}
		}
		return b.String()
	}
	var b strings.Builder
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		save := nsRun(t, n, "", tool(f, mode, "save"))
		chains, err := istiogolden.ReplayIPTables(saveToRestore(save), nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range chains.Names() {
			table, chain, _ := strings.Cut(name, " ")
			fmt.Fprintf(&b, "%s %s %s\n", f, table, chain)
			for _, r := range chains[table][chain] {
				fmt.Fprintf(&b, "  %s\n", r)
			}
		}
	}
	return b.String()
}

// saveToRestore turns iptables-save output into restore input of -N/-A
// lines (counters and policies dropped) that ReplayIPTables reads.
func saveToRestore(save string) string {
	var b strings.Builder
	for _, l := range strings.Split(save, "\n") {
		switch {
		case strings.HasPrefix(l, ":"):
			name, _, _ := strings.Cut(l[1:], " ")
			b.WriteString("-N " + name + "\n")
		case strings.HasPrefix(l, "#"):
		default:
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// TestSidecarMatchesIstioInKernel: for every pod Istio programs, on every
// backend, Istio's golden rules loaded the way Istio's plugin loads them
// and ours applied by the Manager leave the kernel holding the same thing
// (iptables-save of both families, or `nft list` of the istio-proxy-*
// tables) and the same policy routes and addresses. Ours then verify clean
// in the namespace Istio programmed (a pod Istio's agent enrolled is adopted
// without a write), and a second apply changes nothing.
func TestSidecarMatchesIstioInKernel(t *testing.T) {
	testutil.RequireIptables(t, "nft")
	ctx := testCtx(t)
	for _, mode := range allModes {
		m := newManager(t, mode)
		t.Run(string(mode), func(t *testing.T) {
			for _, c := range cases(t) {
				if !c.Programmed() {
					continue
				}
				t.Run(c.Name, func(t *testing.T) {
					p, err := sidecar.Parse(c.Injected, c.IPs())
					if err != nil {
						t.Fatal(err)
					}
					istio, ours := testutil.NewNetNS(t).NS, testutil.NewNetNS(t).NS
					loadIstio(t, istio, c, mode)
					if err := m.ApplySidecar(ctx, ours, p.Options, nil); err != nil {
						t.Fatalf("ApplySidecar: %v", err)
					}
					want, got := listing(t, istio, mode), listing(t, ours, mode)
					if got != want {
						t.Errorf("kernel listing differs\nours:\n%s\nIstio's:\n%s", got, want)
					}
					if g := netState(t, ours); g != c.Routes {
						t.Errorf("routes and addresses:\nours:\n%s\nIstio's:\n%s", g, c.Routes)
					}
					if d, err := m.VerifySidecar(ctx, istio, p.Options); err != nil || !d.Empty() {
						t.Errorf("verify of the pod Istio programmed: %v\n%s", err, d)
					}
					if d, err := m.VerifySidecar(ctx, ours, p.Options); err != nil || !d.Empty() {
						t.Errorf("verify of ours: %v\n%s", err, d)
					}
					if err := m.ApplySidecar(ctx, ours, p.Options, nil); err != nil {
						t.Fatal(err)
					}
					if again := listing(t, ours, mode); again != got {
						t.Errorf("second apply changed the rules:\n%s", again)
					}
				})
			}
		})
	}
}
