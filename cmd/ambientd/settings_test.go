package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// commandVars are the variables every command reads, by the command's
// variable namer over its flags.
func commandVars(t *testing.T) map[string]bool {
	t.Helper()
	vars := map[string]bool{}
	for _, v := range runVars() {
		vars[v] = true
	}
	// The subcommands' own flags, read from their flag sets (-h).
	for _, c := range []struct {
		name  string
		varOf func(string) string
		run   func(args []string, stderr io.Writer) int
	}{
		{"status", statusVar, func(a []string, w io.Writer) int { return runStatus(t.Context(), a, os.Getenv, io.Discard, w) }},
		{"uninstall", uninstallVar, func(a []string, w io.Writer) int { return runUninstall(t.Context(), a, os.Getenv, w) }},
		{"bundle", bundleVar, func(a []string, w io.Writer) int { return runBundle(t.Context(), a, os.Getenv, nil, io.Discard, w) }},
		{"webhook", webhookVar, func(a []string, w io.Writer) int { return runWebhook(t.Context(), a, os.Getenv, w) }},
	} {
		var help strings.Builder
		c.run([]string{"-h"}, &help)
		for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(help.String(), -1) {
			if v := c.varOf(m[1]); v != "" {
				vars[v] = true
			}
		}
	}
	return vars
}

// notSettings are AMBIENTD_ variables the docs name that are no setting
// of a command: the test environments' switches (docs/testenv.md).
var notSettings = map[string]bool{"AMBIENTD_PRIVILEGED": true, "AMBIENTD_E2E_KEEP": true, "AMBIENTD_KUBE_BIN_DIR": true, "AMBIENTD_KUBE_RELEASE": true}

// TestDocumentedVariablesAreRead: every settings table row of the docs
// (`--flag` | `VARIABLE`) names the variable the command reads for that
// flag (settings.Var's rule and its Istio exceptions), and every
// AMBIENTD_ variable the docs, the chart and the manifests name is one a
// command reads — so a renamed flag cannot silently drop a variable an
// operator's DaemonSet sets.
func TestDocumentedVariablesAreRead(t *testing.T) {
	known := commandVars(t)
	row := regexp.MustCompile("(?m)^\\| `--([a-z0-9-]+)` \\| `([A-Z0-9_]+)` \\|")
	anyVar := regexp.MustCompile(`\bAMBIENTD_[A-Z0-9_]*[A-Z0-9]\b`)
	var files []string
	for _, glob := range []string{"../../README.md", "../../docs/*.md", "../../deploy/*.yaml", "../../deploy/*/*.yaml", "../../deploy/helm/ambientd/*.yaml", "../../deploy/helm/ambientd/templates/*"} {
		m, err := filepath.Glob(glob)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	rows := 0
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range row.FindAllStringSubmatch(string(b), -1) {
			rows++
			if !known[m[2]] {
				t.Errorf("%s: --%s is documented with %s, which no command reads", file, m[1], m[2])
			}
		}
		for _, v := range anyVar.FindAllString(string(b), -1) {
			if !known[v] && !notSettings[v] && !strings.HasSuffix(v, "_") {
				t.Errorf("%s names %s, which no command reads", file, v)
			}
		}
	}
	if rows < 60 {
		t.Fatalf("found %d settings rows in the docs, want the 70 or so of agent.md, install.md, readiness.md and commands.md", rows)
	}
}

// TestRunVariables: each flag of `ambientd run` is read from one variable,
// and no two flags share one.
func TestRunVariables(t *testing.T) {
	var f runFlags
	fs := f.flagSet()
	seen := map[string]string{}
	fs.VisitAll(func(fl *flag.Flag) {
		v := runVars()[fl.Name]
		if other, ok := seen[v]; ok {
			t.Errorf("--%s and --%s are both read from %s", fl.Name, other, v)
		}
		seen[v] = fl.Name
	})
	if len(seen) < 60 {
		t.Fatalf("%d variables, want one for each of run's 60 or more flags", len(seen))
	}
}
