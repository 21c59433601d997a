// Command sidecar-validation is ambientd's implementation of the check
// Istio's injector runs as a sidecar pod's istio-validation init container
// (package test/infra/validation): exit 0 when the pod's traffic is
// redirected to its proxy, 126 when not. It takes that container's args:
//
//	sidecar-validation istio-iptables -p 15001 -z 15006 -u 1337 ... --run-validation --skip-rule-apply
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ambientd/ambientd/test/infra/validation"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code, msg := validation.Main(ctx, os.Args[1:])
	stop()
	fmt.Fprintln(os.Stderr, msg)
	if f, err := os.OpenFile("/dev/termination-log", os.O_WRONLY|os.O_TRUNC, 0); err == nil {
		fmt.Fprintln(f, msg)
		f.Close()
	}
	os.Exit(code)
}
