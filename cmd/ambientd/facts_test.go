package main

import (
	"bytes"
	"context"
	"fmt"
	"reflect"
	"regexp"
	"testing"

	"github.com/ambientd/ambientd/test/infra/kubetest"
)

// configMapOverrides are the settings deploy/configmap.yaml deliberately
// sets to something else than the agent's default, and why.
var configMapOverrides = map[string]string{
	"AMBIENTD_HOST_PROC":   "the host's /proc as the DaemonSet mounts it",
	"AMBIENTD_INSTALL_CNI": "the DaemonSet installs the plugin",
	"AMBIENTD_UNTAINT":     "the DaemonSet owns the node's startup taint",
	// The default derives it from --cni-conf-dir; the chart names the
	// hostPath it mounts, which a values file may move.
	"AMBIENTD_CNI_HOST_CONF_DIR": "the host path the DaemonSet mounts the conf dir from",
	// Outside a cluster there is no such account; the chart creates it.
	"AMBIENTD_CNI_PLUGIN_SERVICE_ACCOUNT": "the plugin's own service account, which the chart creates",
}

// TestConfigMapIsTheDefaults: every key of the shipped ConfigMap is a
// variable `ambientd run` reads (none is dead), and every value but the
// deliberate overrides is the flag's default — the ConfigMap spells the
// defaults out for operators to edit; it must not silently change one.
func TestConfigMapIsTheDefaults(t *testing.T) {
	data := kubetest.ShippedConfig(t, "../../deploy/configmap.yaml")
	known := map[string]bool{}
	for _, v := range runVars() {
		known[v] = true
	}
	vars := map[string]string{"NODE_NAME": "n1"}
	for k, v := range data {
		if !known[k] {
			t.Errorf("ConfigMap key %s is no variable of ambientd run: dead configuration", k)
		}
		if _, ok := configMapOverrides[k]; !ok {
			vars[k] = v
		}
	}
	for k := range configMapOverrides {
		if _, ok := data[k]; !ok {
			t.Errorf("override %s is not in the ConfigMap any more: drop it from configMapOverrides", k)
		}
	}
	defaults, err := parseRunFlags(nil, func(k string) string { return map[string]string{"NODE_NAME": "n1"}[k] })
	if err != nil {
		t.Fatal(err)
	}
	shipped, err := parseRunFlags(nil, func(k string) string { return vars[k] })
	if err != nil {
		t.Fatalf("the ConfigMap's settings are refused: %v", err)
	}
	for _, d := range fieldDiffs("", reflect.ValueOf(shipped), reflect.ValueOf(defaults)) {
		t.Errorf("the ConfigMap changes a default: %s", d)
	}
}

// fieldDiffs lists the fields (nested structs walked, unexported ones
// too: fmt prints what reflect may not hand out) where a and b differ.
func fieldDiffs(prefix string, a, b reflect.Value) []string {
	if a.Kind() != reflect.Struct {
		if x, y := fmt.Sprintf("%#v", a), fmt.Sprintf("%#v", b); x != y {
			return []string{fmt.Sprintf("%s: shipped %s, default %s", prefix, x, y)}
		}
		return nil
	}
	var out []string
	for i := range a.NumField() {
		out = append(out, fieldDiffs(prefix+"."+a.Type().Field(i).Name, a.Field(i), b.Field(i))...)
	}
	return out
}

// TestSharedFlagsAgree: a setting `ambientd uninstall` shares with `ambientd
// run` has run's default (uninstall must find what run made).
func TestSharedFlagsAgree(t *testing.T) {
	var stderr bytes.Buffer
	if code := runUninstall(context.Background(), []string{"-h"}, func(string) string { return "" }, &stderr); code != 0 {
		t.Fatalf("uninstall -h: exit %d: %s", code, stderr.String())
	}
	f, err := parseRunFlags([]string{"--node-name=n1"}, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	for name, run := range map[string]string{"iptables": string(f.rules.Mode), "log-level": f.logLevel, "cni-conf-dir": f.install.confDir, "cni-bin-dir": f.install.binDir} {
		m := regexp.MustCompile(`(?m)^  -` + name + ` .*\n(?:    .*\n)*?    .*\(default "([^"]*)"\)`).FindStringSubmatch(stderr.String())
		if m == nil {
			t.Errorf("uninstall has no --%s with a default", name)
			continue
		}
		if m[1] != run {
			t.Errorf("--%s: uninstall's default %q, run's %q", name, m[1], run)
		}
	}
	ipv6 := regexp.MustCompile(`(?m)^  -ipv6\n(?:    .*\n)*?    .*\(default true\)`).MatchString(stderr.String())
	if ipv6 != f.node.Agent.IPv6 {
		t.Errorf("--ipv6: uninstall's default %v, run's %v", ipv6, f.node.Agent.IPv6)
	}
}
