// Command deploy-manifests writes the manifests of deploy/ (the
// kustomization's files and its repair components' roles) from the Helm
// chart in deploy/helm/ambientd, so the chart is their one source.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/ambientd/ambientd/test/helm/chartrender"
)

func main() {
	deploy := flag.String("deploy", "../../deploy", "the deploy/ directory (the chart is its helm/ambientd)")
	flag.Parse()
	files, err := chartrender.DeployManifests(filepath.Join(*deploy, "helm", "ambientd"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "deploy-manifests:", err)
		os.Exit(1)
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(*deploy, name), b, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "deploy-manifests:", err)
			os.Exit(1)
		}
	}
}
