// Command ambientd is the ambient-mesh node agent. main only dispatches to a
// subcommand; each subcommand lives in its own file and keeps to flags and
// wiring.
package main

import (
	"fmt"
	"os"
)

const usage = `usage: ambientd <command> [flags]

commands:
  run      run the node agent (the default when the first argument is a flag)
  status   ask the running agent about this node's pods (root)
  uninstall remove the CNI plugin, its config entry and the host rules from this node
  rules    print the exact in-pod and host rules for given options, touching nothing
  inject   add the readiness gate to manifests' pod templates the mesh will enroll (as the admission policy does)
  check    say whether pods (or a manifest's) are in the mesh and gated, and why (kubeconfig only);
           --cluster-breakers: the CNI settings under which capture silently fails
  webhook  serve the admission webhook that adds the readiness gate (clusters before Kubernetes 1.36)
  bundle   write one archive for a support ticket: settings, status, CNI dirs, rules, errors, Events, metrics (root)
  version  print the version
`

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	args := os.Args[1:]
	cmd := "run"
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "run":
		os.Exit(runCmd(args))
	case "status":
		os.Exit(statusCmd(args))
	case "rules":
		os.Exit(rulesCmd(args))
	case "inject":
		os.Exit(injectCmd(args))
	case "check":
		os.Exit(checkCmd(args))
	case "webhook":
		os.Exit(webhookCmd(args))
	case "bundle":
		os.Exit(bundleCmd(args))
	case "uninstall":
		os.Exit(uninstallCmd(args))
	case "version":
		fmt.Println(version)
	case "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "ambientd: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
}
