package main

import (
	"strings"
	"testing"
	"time"
)

func TestParseRunFlags(t *testing.T) {
	env := func(kv ...string) func(string) string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) string { return m[k] }
	}
	tests := []struct {
		name    string
		args    []string
		env     func(string) string
		wantErr string // substring naming the flag; "" = valid
		check   func(t *testing.T, f runFlags)
	}{
		{name: "node name required", env: env(), wantErr: "--node-name"},
		{name: "defaults", args: []string{"--node-name=n1"}, env: env(), check: func(t *testing.T, f runFlags) {
			if f.ztunnelSocket != "/var/run/ztunnel/ztunnel.sock" || f.cniSocket != "/var/run/ambientd/cni.sock" ||
				f.healthAddr != ":8000" || f.metricsAddr != ":15014" || f.hostProc != "/proc" || f.iptablesMode != "auto" ||
				f.excludeNamespaces != "kube-system" || f.installCNI || !f.dnsCapture || f.ipv6 || f.podLookupTimeout != 10*time.Second {
				t.Errorf("defaults: %+v", f)
			}
		}},
		{name: "env fills flags", env: env("NODE_NAME", "n2", "ZTUNNEL_UDS_ADDRESS", "/tmp/z.sock", "KUBECONFIG", "/k", "AMBIENTD_DNS_CAPTURE", "false"), check: func(t *testing.T, f runFlags) {
			if f.nodeName != "n2" || f.ztunnelSocket != "/tmp/z.sock" || f.kubeconfig != "/k" || f.dnsCapture {
				t.Errorf("env not applied: %+v", f)
			}
		}},
		{name: "flag beats env", args: []string{"--node-name=flag"}, env: env("NODE_NAME", "env"), check: func(t *testing.T, f runFlags) {
			if f.nodeName != "flag" {
				t.Errorf("node name %q, want flag", f.nodeName)
			}
		}},
		{name: "bad env value names variable", env: env("NODE_NAME", "n", "AMBIENTD_IPV6", "maybe"), wantErr: "AMBIENTD_IPV6"},
		{name: "bad iptables", args: []string{"--node-name=n", "--iptables=xt"}, env: env(), wantErr: "--iptables"},
		{name: "relative socket", args: []string{"--node-name=n", "--ztunnel-socket=z.sock"}, env: env(), wantErr: "--ztunnel-socket"},
		{name: "same sockets", args: []string{"--node-name=n", "--ztunnel-socket=/a", "--cni-socket=/a"}, env: env(), wantErr: "--cni-socket"},
		{name: "missing host proc", args: []string{"--node-name=n", "--host-proc=/does/not/exist"}, env: env(), wantErr: "--host-proc"},
		{name: "bad health addr", args: []string{"--node-name=n", "--health-addr=8000"}, env: env(), wantErr: "--health-addr"},
		{name: "bad metrics addr", args: []string{"--node-name=n", "--metrics-addr=x"}, env: env(), wantErr: "--metrics-addr"},
		{name: "bad namespace", args: []string{"--node-name=n", "--exclude-namespaces=ok,Not_OK"}, env: env(), wantErr: "--exclude-namespaces"},
		{name: "install cni accepted", args: []string{"--node-name=n", "--install-cni"}, env: env(), check: func(t *testing.T, f runFlags) {
			if !f.installCNI {
				t.Error("--install-cni not set")
			}
		}},
		{name: "bad node name", args: []string{"--node-name=N_1"}, env: env(), wantErr: "--node-name"},
		{name: "bad retry base", args: []string{"--node-name=n", "--retry-base-delay=0s"}, env: env(), wantErr: "--retry-base-delay"},
		{name: "retry max below base", args: []string{"--node-name=n", "--retry-base-delay=2s", "--retry-max-delay=1s"}, env: env(), wantErr: "--retry-max-delay"},
		{name: "bad kube qps", args: []string{"--node-name=n", "--kube-qps=0"}, env: env(), wantErr: "--kube-qps"},
		{name: "kube burst from env", env: env("NODE_NAME", "n", "AMBIENTD_KUBE_BURST", "200"), check: func(t *testing.T, f runFlags) {
			if f.kubeBurst != 200 || f.kubeQPS != defaultKubeQPS {
				t.Errorf("kube burst %d qps %v, want 200 and the default", f.kubeBurst, f.kubeQPS)
			}
		}},
		{name: "stray argument", args: []string{"--node-name=n", "extra"}, env: env(), wantErr: "unexpected"},
		{name: "exclude list", args: []string{"--node-name=n", "--exclude-namespaces= a, b ,,"}, env: env(), check: func(t *testing.T, f runFlags) {
			if got := strings.Join(f.excluded(), ","); got != "a,b" {
				t.Errorf("excluded %q", got)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := parseRunFlags(tt.args, tt.env)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one naming %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.check != nil {
				tt.check(t, f)
			}
		})
	}
}
