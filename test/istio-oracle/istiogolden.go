package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
)

// istioPluginGoldens pairs cases with the golden files Istio ships for its
// own plugin test (cni/pkg/plugin/testdata, TestIPTablesRuleGeneration): the
// same pods must give byte-identical iptables output, which proves this
// harness drives the plugin as Istio's own test does.
var istioPluginGoldens = map[string]string{
	"redirect-default": "basic.txt.golden",
	"tproxy":           "tproxy.txt.golden",
	"dns-capture":      "dns.txt.golden",
	"invalid-drop":     "invalid-drop.txt.golden",
	"custom-uid-gid":   "custom-uid.txt.golden",
}

// checkIstioGoldens compares the generated iptables.v4 sections with Istio's
// files in the module cache.
func checkIstioGoldens(generated map[string][]byte) error {
	dir, err := istioModuleDir()
	if err != nil {
		return err
	}
	for name, golden := range istioPluginGoldens {
		ar, ok := generated[name+".txtar"]
		if !ok {
			continue // not generated in this (filtered) run
		}
		want, err := os.ReadFile(filepath.Join(dir, "cni/pkg/plugin/testdata", golden))
		if err != nil {
			return err
		}
		if got := section(ar, "iptables.v4"); !bytes.Equal(got, want) {
			return fmt.Errorf("case %s: iptables.v4 differs from Istio's own %s:\n%s\n--- Istio's\n%s", name, golden, got, want)
		}
	}
	return nil
}

// istioModuleDir is the pinned istio.io/istio in the module cache.
func istioModuleDir() (string, error) {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "", fmt.Errorf("no build info")
	}
	var version string
	for _, d := range bi.Deps {
		if d.Path == "istio.io/istio" {
			version = d.Version
		}
	}
	if version == "" {
		return "", fmt.Errorf("istio.io/istio not in build info")
	}
	out, err := exec.Command("go", "env", "GOMODCACHE").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMODCACHE: %w", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "istio.io", "istio@"+version), nil
}

// section returns one file of a txtar archive produced by archive.
func section(ar []byte, name string) []byte {
	marker := []byte("-- " + name + " --\n")
	i := bytes.Index(ar, marker)
	if i < 0 {
		return nil
	}
	rest := ar[i+len(marker):]
	if j := bytes.Index(rest, []byte("\n-- ")); j >= 0 {
		return rest[:j+1]
	}
	return rest
}
