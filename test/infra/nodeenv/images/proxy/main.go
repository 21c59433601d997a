// Command proxy is the node environment's stand-in for Istio's istio-proxy
// in sidecar-mode tests: it listens where Envoy would be captured to —
// 15001 (outbound) and 15006 (inbound), IPv4 and IPv6 — and answers each
// connection with one line, "istio-proxy <port> <original destination>"
// (SO_ORIGINAL_DST, "-" when none), so a test sees where a connection
// landed; it serves Envoy's health port 15021 (/healthz/ready), which the
// injected startup and readiness probes ask. Every connection is logged.
//
// Run as `istio-iptables ...` (an istio-init container, which a pod injected
// without CNI has) it exits 0 at once: it programs nothing.
//
// Follows: the ports and health path of Istio 1.31's injected istio-proxy
// (the revision test/istio-oracle pins; its injector's sidecar template).
//
// Does not emulate: Envoy — no xDS, no mTLS, no forwarding to the
// destination (a connection gets one line and is closed), no admin port
// (15000), no stats (15090), no pilot-agent (no SDS, no DNS capture), no
// iptables from istio-init.
package main

import (
	"context"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ambientd/ambientd/test/infra/validation"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "istio-iptables" {
		log.Printf("istio-iptables %v: the stand-in programs nothing", os.Args[2:])
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	for _, port := range []int{15001, 15006} {
		for _, network := range []string{"tcp4", "tcp6"} {
			l, err := net.Listen(network, fmt.Sprintf(":%d", port))
			if err != nil {
				if network == "tcp6" {
					continue // a pod without IPv6
				}
				log.Fatalf("listen %s :%d: %v", network, port, err)
			}
			go serve(l.(*net.TCPListener), port, network == "tcp6")
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz/ready", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ready") })
	srv := &http.Server{Addr: ":15021", Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	log.Printf("stand-in istio-proxy listening on 15001, 15006, health on 15021")
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		log.Fatal(err)
	}
}

func serve(l *net.TCPListener, port int, v6 bool) {
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			return
		}
		dst := "-"
		if d, err := validation.OriginalDst(c, v6); err == nil {
			local := netip.MustParseAddrPort(c.LocalAddr().String())
			if d != local {
				dst = d.String()
			}
		}
		log.Printf("accepted on %d from %s, original destination %s", port, c.RemoteAddr(), dst)
		_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "istio-proxy %d %s\n", port, dst)
		c.Close()
	}
}
