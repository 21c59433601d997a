// Command ztunnel-emulator stands in for ztunnel in end-to-end tests and the
// demo: it connects to the agent's ZDS socket, speaks the protocol as real
// ztunnel 1.24+ does and, with --netns-mode, listens on 15001/15006/15008
// inside every pod netns it receives. GET /state on --status-addr shows
// everything it saw. It is test/infra/ztunnelemu as a program: that
// package says which ztunnel it follows and what it does not emulate.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
	zp "github.com/ambientd/ambientd/ztunnelproto"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ztunnel-emulator:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg := ztunnelemu.Config{Nacks: map[string]string{}}
	var statusAddr string
	var debug bool
	flag.StringVar(&cfg.SocketPath, "socket", zp.DefaultSocketPath, "the agent's ZDS socket to connect to")
	flag.BoolVar(&cfg.NetnsMode, "netns-mode", false, "enter each workload netns and listen on 15001, 15006, 15008 there")
	flag.BoolVar(&cfg.ExitOnProtocolError, "exit-on-protocol-error", false, "exit (status 1) on a protocol violation, as real ztunnel does")
	flag.Func("nack", "namespace/name=message (or uid=message): answer Adds of that workload with an error; repeatable", func(s string) error {
		key, msg, ok := strings.Cut(s, "=")
		if !ok || key == "" || msg == "" {
			return fmt.Errorf("want namespace/name=message, got %q", s)
		}
		cfg.Nacks[key] = msg
		return nil
	})
	flag.StringVar(&statusAddr, "status-addr", "", "loopback host:port for the HTTP control API (GET /state, POST/DELETE /nack); empty: off")
	flag.IntVar(&cfg.MaxRecords, "max-records", 0, "cap of each record list of GET /state (requests, accepted connections), oldest dropped; 0: the library's default")
	flag.BoolVar(&debug, "debug", false, "debug logging")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", flag.Args())
	}
	level := slog.LevelInfo
	if debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	emu := ztunnelemu.New(cfg, log)

	if statusAddr != "" {
		l, err := listenLoopback(statusAddr)
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: emu.Handler(), ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("status server", "error", err)
			}
		}()
		defer srv.Close()
		log.Info("status API listening", "addr", l.Addr().String())
	}
	return emu.Run(ctx)
}

// listenLoopback refuses anything but a loopback address: the API can make
// the emulator refuse workloads and shows pod details.
func listenLoopback(addr string) (net.Listener, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("--status-addr %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return nil, fmt.Errorf("--status-addr %q: must be a loopback address", addr)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("status API: %w", err)
	}
	return l, nil
}
