package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/settings"
)

// uninstallCmd removes ambientd from this node: the plugin's config entry
// (or the owned conflist; a converted .conf is restored), the plugin binary,
// the host probe rules and probe ipsets. Other components' CNI entries and
// pods' in-pod rules are left alone.
func uninstallCmd(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return runUninstall(ctx, args, os.Getenv, os.Stderr)
}

// uninstallVar names the uninstall's variables: the agent's for the
// settings it shares with run, its own for its bound.
func uninstallVar(name string) string {
	if name == "timeout" {
		return settings.CommandVar("uninstall", name)
	}
	return settings.Var(name)
}

func runUninstall(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	fs := flag.NewFlagSet("ambientd uninstall", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var inst installFlags
	inst.register(fs)
	mode := fs.String("iptables", "auto", "iptables variant the host rules were made with: auto, legacy or nft")
	ipv6 := fs.Bool("ipv6", iptables.DefaultIPv6, "also remove the IPv6 host rules and probe set (the agent's default; a node without ip6tables has none)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	timeout := fs.Duration("timeout", time.Minute, "bound on the whole uninstall")
	err := settings.Parse(fs, args, getenv, uninstallVar)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case settings.IsUsageError(err):
		return 2
	}
	if err == nil && fs.NArg() > 0 {
		err = fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	level, lerr := parseLevel(*logLevel)
	if err == nil && lerr != nil {
		err = fmt.Errorf("--log-level: %w", lerr)
	}
	m, merr := iptables.ParseMode(*mode)
	if err == nil && merr != nil {
		err = fmt.Errorf("--iptables: %w", merr)
	}
	var cfg cniinstall.Config
	if err == nil {
		// Uninstall never reads the source binary; any absolute path will do.
		if inst.binSource == "" {
			inst.binSource = "/" + cniapi.PluginType
		}
		cfg, err = inst.config("/unused.sock", nil)
	}
	if err == nil && *timeout <= 0 {
		err = fmt.Errorf("--timeout %v: must be positive", *timeout)
	}
	if err != nil {
		fmt.Fprintf(stderr, "ambientd uninstall: %v\n", err)
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	installer, err := cniinstall.New(cfg, log)
	if err == nil {
		var rules *iptables.Manager
		rules, err = iptables.NewManager(ctx, iptables.Config{IPv6: *ipv6, Mode: m}, log.With("component", "iptables"))
		if err != nil && *ipv6 {
			// No IPv6 tools of that backend on this node: then it has no
			// IPv6 rules of it either; IPv4 is all there is to remove.
			log.Info("IPv6 rule tools unavailable; removing the IPv4 rules", "error", err)
			rules, err = iptables.NewManager(ctx, iptables.Config{IPv6: false, Mode: m}, log.With("component", "iptables"))
		}
		if err == nil {
			err = daemon.UninstallNode(ctx, installer, rules)
		}
	}
	if err != nil {
		log.Error("ambientd uninstall failed", "error", err)
		return 1
	}
	log.Info("ambientd uninstalled from this node", "cni_bin_dir", cfg.BinDir, "cni_conf_dir", cfg.ConfDir)
	return 0
}
