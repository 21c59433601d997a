// Command multus is the test-only double of Multus CNI's thin plugin
// binary (a meta-plugin that runs its delegates, the cluster network
// first, and returns that network's result): test/infra/multusemu says
// which Multus version's behaviour it follows and what it leaves out.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"
	cniversion "github.com/containernetworking/cni/pkg/version"

	"github.com/ambientd/ambientd/test/infra/multusemu"
)

func main() {
	var p multusemu.Plugin
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add: func(args *skel.CmdArgs) error {
			res, err := p.Add(args)
			if err != nil {
				return err
			}
			return res.Print()
		},
		Del:   p.Del,
		Check: p.Check,
	}, cniversion.All, "multus double (test only): meta-plugin that delegates to other CNI plugins")
}
