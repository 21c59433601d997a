package main

import (
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/nodeagent/cniinstall"
)

func TestInstallFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		check   func(t *testing.T, f installFlags)
	}{
		{name: "defaults", check: func(t *testing.T, f installFlags) {
			if f.binDir != "/host/opt/cni/bin" || f.confDir != "/host/etc/cni/net.d" || f.owned || f.ownedName != "00-ambientd.conflist" || f.daemonSet != "ambientd" || f.namespace != "istio-system" {
				t.Errorf("defaults: %+v", f)
			}
		}},
		{name: "env sets, flag wins", args: []string{"--cni-bin-dir=/b"},
			env: map[string]string{"AMBIENTD_CNI_BIN_DIR": "/env", "AMBIENTD_CNI_CONF_DIR": "/c", "AMBIENTD_CNI_OWNED_CONFIG": "true", "POD_NAMESPACE": "mesh", "AMBIENTD_CNI_CONF_NAME": "10-x.conflist"},
			check: func(t *testing.T, f installFlags) {
				if f.binDir != "/b" || f.confDir != "/c" || !f.owned || f.namespace != "mesh" || f.confName != "10-x.conflist" {
					t.Errorf("got %+v", f)
				}
			}},
		{name: "relative conf dir", args: []string{"--cni-conf-dir=etc"}, wantErr: "absolute"},
		{name: "bad conf name", args: []string{"--cni-conf-name=x.yaml"}, wantErr: ".conflist"},
		{name: "bad owned name", env: map[string]string{"AMBIENTD_CNI_OWNED_CONFIG_NAME": "00-a.conf"}, wantErr: ".conflist"},
		{name: "bad plugin level", args: []string{"--cni-plugin-log-level=loud"}, wantErr: "--cni-plugin-log-level"},
		{name: "bad plugin timeout", args: []string{"--cni-plugin-timeout=0s"}, wantErr: "--cni-plugin-timeout"},
		{name: "bad env value", env: map[string]string{"AMBIENTD_CNI_OWNED_CONFIG": "maybe"}, wantErr: "AMBIENTD_CNI_OWNED_CONFIG"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fs := flag.NewFlagSet("t", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			var f installFlags
			f.register(fs)
			err := fs.Parse(tc.args)
			if err == nil {
				err = applyEnv(fs, installEnvOf, func(k string) string { return tc.env[k] })
			}
			if err == nil {
				var c cniinstall.Config
				c, err = f.config("/var/run/ambientd/cni.sock", []string{"kube-system"})
				if err == nil && (c.Entry.AgentSocket != "/var/run/ambientd/cni.sock" || c.Entry.ExcludeNamespaces[0] != "kube-system" || !strings.HasSuffix(c.BinSource, "/ambientd-cni")) {
					t.Errorf("config %+v", c)
				}
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, f)
		})
	}
}
