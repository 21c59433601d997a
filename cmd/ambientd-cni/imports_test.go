package main

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestImports keeps the plugin light: it is exec'd for every pod, so it must
// not pull in client-go or the agent. It shares cniapi, and the installer's
// file logic (cniinstall, which imports no Kubernetes package) to
// finish an uninstall the agent left (docs/install.md).
func TestImports(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "list", "-deps", "github.com/ambientd/ambientd/cmd/ambientd-cni").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		switch {
		case strings.HasPrefix(pkg, "k8s.io/"),
			strings.HasPrefix(pkg, "github.com/ambientd/ambientd/nodeagent/") && pkg != "github.com/ambientd/ambientd/cniinstall",
			strings.HasPrefix(pkg, "github.com/ambientd/ambientd/iptables"),
			strings.HasPrefix(pkg, "github.com/ambientd/ambientd/ztunnelproto"):
			t.Errorf("ambientd-cni depends on %s", pkg)
		}
	}
}
