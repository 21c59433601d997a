// Command istio-validation is Istio's own validation check, built from the
// pinned Istio release: the `istio-iptables` subcommand of pilot-agent, which
// the injected istio-validation init container runs as
// `pilot-agent istio-iptables ... --run-validation --skip-rule-apply`.
//
// Run it with that container's args, in the pod's network namespace, as the
// proxy uid/gid (1337):
//
//	istio-validation istio-iptables -p 15001 -z 15006 -u 1337 -m REDIRECT \
//	    -i '*' -x '' -b '*' -d 15090,15021,15020 --run-validation --skip-rule-apply
//
// It listens on 127.0.0.1:15001 and :15006 (::1 in an IPv6 pod), dials
// 127.0.0.6:15002 and exits 0 when a listener sees original destination port
// 15002 (SO_ORIGINAL_DST), 126 after 5 s otherwise.
package main

import (
	"os"

	"github.com/spf13/cobra"

	"istio.io/istio/pkg/log"
	iptables "istio.io/istio/tools/istio-iptables/pkg/cmd"
)

func main() {
	logOpts := log.DefaultOptions()
	root := &cobra.Command{
		Use:          "pilot-agent",
		SilenceUsage: true,
		FParseErrWhitelist: cobra.FParseErrWhitelist{
			UnknownFlags: true,
		},
	}
	logOpts.AttachCobraFlags(root)
	root.AddCommand(iptables.GetCommand(logOpts))
	if err := root.Execute(); err != nil {
		log.Error(err)
		os.Exit(-1)
	}
}
