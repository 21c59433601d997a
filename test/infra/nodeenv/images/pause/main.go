// Command pause is the node environment's pod sandbox ("pause") image
// entrypoint: it holds the pod's namespaces open, reaps the zombies of the
// pod's processes (it is PID 1 of the sandbox), and exits 0 on SIGINT or
// SIGTERM, like the upstream pause container.
//
// Follows: Kubernetes' pause (kubernetes/kubernetes build/pause/linux/pause.c)
// as kubelet 1.37's sandbox image runs it.
//
// Does not emulate: its -v version flag, and its being a tiny static C
// binary (this is Go); nothing else of it is used.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
