package main

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/settings"
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
			// Owned mode by default: reboot-safe with a primary CNI that
			// rewrites its conflist at start.
			if f.binDir != "/host/opt/cni/bin" || f.confDir != "/host/etc/cni/net.d" || !f.owned || f.ownedName != "00-ambientd.conflist" || f.daemonSet != "ambientd" || f.namespace != "istio-system" ||
				f.pollInterval != 2*time.Second || f.resync != 30*time.Second || f.repairLimit != 5 || f.repairWindow != time.Minute {
				t.Errorf("defaults: %+v", f)
			}
			if c, err := f.config("/s", nil); err != nil || c.InPlace {
				t.Errorf("default config: in place %v, %v", c.InPlace, err)
			}
		}},
		{name: "env sets, flag wins", args: []string{"--cni-bin-dir=/b", "--cni-poll-interval=5s"},
			env: map[string]string{"AMBIENTD_CNI_BIN_DIR": "/env", "AMBIENTD_CNI_CONF_DIR": "/c", "AMBIENTD_CNI_OWNED_CONFIG": "false", "POD_NAMESPACE": "mesh", "AMBIENTD_CNI_CONF_NAME": "10-x.conflist",
				"AMBIENTD_CNI_POLL_INTERVAL": "1s", "AMBIENTD_CNI_RESYNC_INTERVAL": "10s", "AMBIENTD_CNI_REPAIR_LIMIT": "9", "AMBIENTD_CNI_REPAIR_WINDOW": "2m"},
			check: func(t *testing.T, f installFlags) {
				if f.binDir != "/b" || f.confDir != "/c" || f.owned || f.namespace != "mesh" || f.confName != "10-x.conflist" ||
					f.pollInterval != 5*time.Second || f.resync != 10*time.Second || f.repairLimit != 9 || f.repairWindow != 2*time.Minute {
					t.Errorf("got %+v", f)
				}
				if c, err := f.config("/s", nil); err != nil || !c.InPlace || c.PollInterval != 5*time.Second || c.Resync != 10*time.Second || c.RepairLimit != 9 || c.RepairWindow != 2*time.Minute {
					t.Errorf("config %+v, %v", c, err)
				}
			}},
		{name: "install lease: host conf dir and TTL by default", check: func(t *testing.T, f installFlags) {
			// The DaemonSet mounts the host's /etc/cni/net.d at
			// /host/etc/cni/net.d: the plugin, on the host, needs the former.
			if c, err := f.config("/s", nil); err != nil || c.HostConfDir != "/etc/cni/net.d" || c.LeaseTTL != 10*time.Minute {
				t.Errorf("host conf dir %q, lease TTL %v, %v", c.HostConfDir, c.LeaseTTL, err)
			}
		}},
		{name: "install lease: conf dir not under /host is the host's", args: []string{"--cni-conf-dir=/etc/cni/net.d"}, check: func(t *testing.T, f installFlags) {
			if c, err := f.config("/s", nil); err != nil || c.HostConfDir != "/etc/cni/net.d" {
				t.Errorf("host conf dir %q, %v", c.HostConfDir, err)
			}
		}},
		{name: "install lease: settings", env: map[string]string{"AMBIENTD_CNI_HOST_CONF_DIR": "/var/lib/cni/net.d", "AMBIENTD_CNI_INSTALL_LEASE_TTL": "30m"}, check: func(t *testing.T, f installFlags) {
			if c, err := f.config("/s", nil); err != nil || c.HostConfDir != "/var/lib/cni/net.d" || c.LeaseTTL != 30*time.Minute {
				t.Errorf("host conf dir %q, lease TTL %v, %v", c.HostConfDir, c.LeaseTTL, err)
			}
		}},
		{name: "bad lease TTL", args: []string{"--cni-install-lease-ttl=500ms"}, wantErr: "--cni-install-lease-ttl"},
		{name: "relative host conf dir", args: []string{"--cni-host-conf-dir=etc"}, wantErr: "--cni-host-conf-dir"},
		{name: "bad poll interval", args: []string{"--cni-poll-interval=1ms"}, wantErr: "--cni-poll-interval"},
		{name: "bad repair limit", env: map[string]string{"AMBIENTD_CNI_REPAIR_LIMIT": "0"}, wantErr: "--cni-repair-limit"},
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
			err := settings.Parse(fs, tc.args, func(k string) string { return tc.env[k] }, settings.Var)
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
