// Command ambientd-cni is the chained CNI plugin that hands pod sandbox
// events to the ambientd node agent. The logic lives in cniplugin;
// this main only wires it to skel.
package main

import (
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ambientd/ambientd/cniplugin"
	"github.com/ambientd/ambientd/cniplugin/procinit"
)

func main() {
	p := &cniplugin.Plugin{Stdout: os.Stdout, Stderr: os.Stderr, Started: procinit.At}
	skel.PluginMainFuncs(p.Funcs(), cniplugin.SupportedVersions, cniplugin.About)
}
