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
			if f.node.ZtunnelSocket != "/var/run/ztunnel/ztunnel.sock" || f.node.CNISocket != "/var/run/ambientd/cni.sock" ||
				f.node.HealthAddr != ":8000" || f.node.MetricsAddr != ":15014" || f.node.Agent.HostProc != "/proc" || string(f.rules.Mode) != "auto" ||
				strings.Join(f.node.Agent.Policy.ExcludeNamespaces, ",") != "kube-system" || f.installCNI || !f.node.Agent.DNSCapture || !f.node.Agent.IPv6 || f.node.Agent.PodLookupTimeout != 10*time.Second ||
				f.node.Agent.VerifyInterval != time.Minute || f.node.Agent.RunDir != "/var/run/ambientd" || f.node.ZtunnelSocketMode != 0o600 || len(f.node.ZtunnelAllowedUIDs) != 1 || f.node.ZtunnelAllowedUIDs[0] != 0 {
				t.Errorf("defaults: %+v", f)
			}
		}},
		{name: "env fills flags", env: env("NODE_NAME", "n2", "ZTUNNEL_UDS_ADDRESS", "/tmp/z.sock", "KUBECONFIG", "/k", "AMBIENTD_DNS_CAPTURE", "false"), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.NodeName != "n2" || f.node.ZtunnelSocket != "/tmp/z.sock" || f.kubeconfig != "/k" || f.node.Agent.DNSCapture {
				t.Errorf("env not applied: %+v", f)
			}
		}},
		{name: "flag beats env", args: []string{"--node-name=flag"}, env: env("NODE_NAME", "env"), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.NodeName != "flag" {
				t.Errorf("node name %q, want flag", f.node.Agent.NodeName)
			}
		}},
		{name: "bad env value names variable", env: env("NODE_NAME", "n", "AMBIENTD_IPV6", "maybe"), wantErr: "AMBIENTD_IPV6"},
		{name: "bad iptables", args: []string{"--node-name=n", "--iptables=xt"}, env: env(), wantErr: "--iptables"},
		{name: "ztunnel uids from env", env: env("NODE_NAME", "n", "AMBIENTD_ZTUNNEL_ALLOWED_UIDS", "0, 1337"), check: func(t *testing.T, f runFlags) {
			if u := f.node.ZtunnelAllowedUIDs; len(u) != 2 || u[0] != 0 || u[1] != 1337 {
				t.Errorf("allowed uids %v, want [0 1337]", u)
			}
		}},
		{name: "bad ztunnel uid", args: []string{"--node-name=n", "--ztunnel-allowed-uids=root"}, env: env(), wantErr: "--ztunnel-allowed-uids"},
		{name: "no ztunnel uid", args: []string{"--node-name=n", "--ztunnel-allowed-uids=,"}, env: env(), wantErr: "--ztunnel-allowed-uids"},
		{name: "relative socket", args: []string{"--node-name=n", "--ztunnel-socket=z.sock"}, env: env(), wantErr: "--ztunnel-socket"},
		{name: "same sockets", args: []string{"--node-name=n", "--ztunnel-socket=/a", "--cni-socket=/a"}, env: env(), wantErr: "--cni-socket"},
		{name: "missing host proc", args: []string{"--node-name=n", "--host-proc=/does/not/exist"}, env: env(), wantErr: "--host-proc"},
		{name: "bad health addr", args: []string{"--node-name=n", "--health-addr=8000"}, env: env(), wantErr: "--health-addr"},
		{name: "bad metrics addr", args: []string{"--node-name=n", "--metrics-addr=x"}, env: env(), wantErr: "--metrics-addr"},
		{name: "bad namespace", args: []string{"--node-name=n", "--exclude-namespaces=ok,Not_OK"}, env: env(), wantErr: "--exclude-namespaces"},
		{name: "system namespace default", args: []string{"--node-name=n"}, env: env(), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.Policy.SystemNamespace != "istio-system" {
				t.Errorf("system namespace %q, want istio-system", f.node.Agent.Policy.SystemNamespace)
			}
		}},
		{name: "system namespace from env", env: env("NODE_NAME", "n", "AMBIENTD_SYSTEM_NAMESPACE", "mesh-system"), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.Policy.SystemNamespace != "mesh-system" {
				t.Errorf("system namespace %q, want mesh-system", f.node.Agent.Policy.SystemNamespace)
			}
		}},
		{name: "system namespace empty", args: []string{"--node-name=n", "--system-namespace="}, env: env(), wantErr: "--system-namespace"},
		{name: "bad system namespace", args: []string{"--node-name=n", "--system-namespace=Istio_System"}, env: env(), wantErr: "--system-namespace"},
		{name: "install cni accepted", args: []string{"--node-name=n", "--install-cni"}, env: env(), check: func(t *testing.T, f runFlags) {
			if !f.installCNI {
				t.Error("--install-cni not set")
			}
		}},
		{name: "Istio's metric names on by default", args: []string{"--node-name=n"}, env: env(), check: func(t *testing.T, f runFlags) {
			if !f.node.IstioMetrics {
				t.Error("--istio-metrics off by default")
			}
		}},
		{name: "Istio's metric names off from env", args: []string{"--node-name=n"}, env: env("AMBIENTD_ISTIO_METRICS", "false"), check: func(t *testing.T, f runFlags) {
			if f.node.IstioMetrics {
				t.Error("AMBIENTD_ISTIO_METRICS=false did not turn --istio-metrics off")
			}
		}},
		{name: "bad node name", args: []string{"--node-name=N_1"}, env: env(), wantErr: "--node-name"},
		{name: "handover from env", args: []string{"--node-name=n", "--install-cni"}, env: env("AMBIENTD_HANDOVER", "istio-nftables"), check: func(t *testing.T, f runFlags) {
			if f.handover != "istio-nftables" {
				t.Errorf("handover %q, want istio-nftables", f.handover)
			}
		}},
		{name: "handover default none", args: []string{"--node-name=n"}, env: env(), check: func(t *testing.T, f runFlags) {
			if f.handover != "none" {
				t.Errorf("handover %q, want none", f.handover)
			}
		}},
		{name: "gc percent default 50", args: []string{"--node-name=n"}, env: env(), check: func(t *testing.T, f runFlags) {
			if f.gcPercent != 50 {
				t.Errorf("gc percent %d, want 50", f.gcPercent)
			}
		}},
		{name: "gc percent from env", args: []string{"--node-name=n"}, env: env("AMBIENTD_GC_PERCENT", "0"), check: func(t *testing.T, f runFlags) {
			if f.gcPercent != 0 {
				t.Errorf("gc percent %d, want 0 (the runtime's)", f.gcPercent)
			}
		}},
		{name: "bad gc percent", args: []string{"--node-name=n", "--gc-percent=-5"}, env: env(), wantErr: "--gc-percent"},
		{name: "bad handover", args: []string{"--node-name=n", "--install-cni", "--handover=linkerd"}, env: env(), wantErr: "--handover"},
		{name: "handover needs install-cni", args: []string{"--node-name=n", "--handover=istio"}, env: env(), wantErr: "needs --install-cni"},
		{name: "bad retry base", args: []string{"--node-name=n", "--retry-base-delay=0s"}, env: env(), wantErr: "--retry-base-delay"},
		{name: "retry max below base", args: []string{"--node-name=n", "--retry-base-delay=2s", "--retry-max-delay=1s"}, env: env(), wantErr: "--retry-max-delay"},
		{name: "bad kube qps", args: []string{"--node-name=n", "--kube-qps=0"}, env: env(), wantErr: "--kube-qps"},
		{name: "kube burst from env", env: env("NODE_NAME", "n", "AMBIENTD_KUBE_BURST", "200"), check: func(t *testing.T, f runFlags) {
			if f.kubeBurst != 200 || f.kubeQPS != defaultKubeQPS {
				t.Errorf("kube burst %d qps %v, want 200 and the default", f.kubeBurst, f.kubeQPS)
			}
		}},
		{name: "node readiness wired", env: env("NODE_NAME", "n", "AMBIENTD_UNTAINT", "true"), args: []string{"--taint-when-unready", "--taint-grace-period=2s"},
			check: func(t *testing.T, f runFlags) {
				nr := f.node.NodeReady
				if nr.NodeName != "n" || !nr.Untaint || !nr.TaintWhenUnready || nr.TaintGracePeriod != 2*time.Second {
					t.Errorf("node readiness config %+v", nr)
				}
				if f.install.confDir != "/host/etc/cni/net.d" || f.node.Agent.PodConditionType != "ambient.istio.io/enrolled" {
					t.Errorf("cni conf dir %q, pod condition type %q: want the defaults", f.install.confDir, f.node.Agent.PodConditionType)
				}
			}},
		{name: "pod condition type from env", env: env("NODE_NAME", "n", "AMBIENTD_POD_CONDITION_TYPE", "example.com/meshed", "AMBIENTD_CNI_CONF_DIR", "/x/net.d"),
			check: func(t *testing.T, f runFlags) {
				if f.node.Agent.PodConditionType != "example.com/meshed" || f.install.confDir != "/x/net.d" {
					t.Errorf("pod condition type %q, cni conf dir %q", f.node.Agent.PodConditionType, f.install.confDir)
				}
			}},
		{name: "bad pod condition type", args: []string{"--node-name=n", "--pod-condition-type=a/b/c"}, env: env(), wantErr: "--pod-condition-type"},
		{name: "relative cni conf dir", args: []string{"--node-name=n", "--cni-conf-dir=net.d"}, env: env(), wantErr: "--cni-conf-dir"},
		{name: "bad taint grace", args: []string{"--node-name=n", "--taint-grace-period=0s"}, env: env(), wantErr: "--taint-grace-period"},
		{name: "verify interval from env", env: env("NODE_NAME", "n", "AMBIENTD_VERIFY_INTERVAL", "0"), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.VerifyInterval != 0 {
				t.Errorf("verify interval %v, want 0 (off)", f.node.Agent.VerifyInterval)
			}
		}},
		{name: "verify interval too short", args: []string{"--node-name=n", "--verify-interval=1ms"}, env: env(), wantErr: "--verify-interval"},
		{name: "ztunnel grace default", args: []string{"--node-name=n"}, env: env(), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.ZtunnelGrace != 5*time.Second {
				t.Errorf("ztunnel grace %v, want 5s", f.node.Agent.ZtunnelGrace)
			}
		}},
		{name: "ztunnel grace off from env", env: env("NODE_NAME", "n", "AMBIENTD_ZTUNNEL_GRACE", "0"), check: func(t *testing.T, f runFlags) {
			if f.node.Agent.ZtunnelGrace != 0 {
				t.Errorf("ztunnel grace %v, want 0 (never)", f.node.Agent.ZtunnelGrace)
			}
		}},
		{name: "ztunnel grace negative", args: []string{"--node-name=n", "--ztunnel-grace=-1s"}, env: env(), wantErr: "--ztunnel-grace"},
		{name: "relative run dir", args: []string{"--node-name=n", "--run-dir=run"}, env: env(), wantErr: "--run-dir"},
		{name: "socket mode from env", env: env("NODE_NAME", "n", "AMBIENTD_ZTUNNEL_SOCKET_MODE", "0660"), check: func(t *testing.T, f runFlags) {
			if m := f.node.ZtunnelSocketMode; m != 0o660 {
				t.Errorf("socket mode %v, want 0660", m)
			}
		}},
		{name: "socket mode without owner rw", args: []string{"--node-name=n", "--ztunnel-socket-mode=0066"}, env: env(), wantErr: "--ztunnel-socket-mode"},
		{name: "socket mode not octal", args: []string{"--node-name=n", "--ztunnel-socket-mode=rw"}, env: env(), wantErr: "--ztunnel-socket-mode"},
		{name: "kubelet uid not numeric", args: []string{"--node-name=n", "--kubelet-uid=kubelet"}, env: env(), wantErr: "--kubelet-uid"},
		{name: "kubelet uid from env", env: env("NODE_NAME", "n", "AMBIENTD_KUBELET_UID", "0"), check: func(t *testing.T, f runFlags) {
			if u := f.rules.KubeletUID; u == nil || *u != 0 {
				t.Errorf("kubelet uid %v, want 0", u)
			}
		}},
		{name: "capturable runtime handlers default", args: []string{"--node-name=n"}, env: env(), check: func(t *testing.T, f runFlags) {
			if got := strings.Join(f.node.Agent.Policy.CapturableRuntimeHandlers, ","); got != "default,runc,crun" {
				t.Errorf("capturable runtime handlers %q, want default,runc,crun", got)
			}
		}},
		{name: "capturable runtime handlers from env", args: []string{"--node-name=n"}, env: env("AMBIENTD_CAPTURABLE_RUNTIME_HANDLERS", " runc, nvidia ,"), check: func(t *testing.T, f runFlags) {
			if got := strings.Join(f.node.Agent.Policy.CapturableRuntimeHandlers, ","); got != "runc,nvidia" {
				t.Errorf("capturable runtime handlers %q, want runc,nvidia", got)
			}
		}},
		{name: "bad runtime handler", args: []string{"--node-name=n", "--capturable-runtime-handlers=runc,Kata_QEMU"}, env: env(), wantErr: "--capturable-runtime-handlers"},
		{name: "no runtime handler", args: []string{"--node-name=n", "--capturable-runtime-handlers=,"}, env: env(), wantErr: "--capturable-runtime-handlers"},
		{name: "stray argument", args: []string{"--node-name=n", "extra"}, env: env(), wantErr: "unexpected"},
		{name: "exclude list", args: []string{"--node-name=n", "--exclude-namespaces= a, b ,,"}, env: env(), check: func(t *testing.T, f runFlags) {
			if got := strings.Join(f.node.Agent.Policy.ExcludeNamespaces, ","); got != "a,b" {
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

// TestSeveralBadFlagsReportTheSameOne: with more than one bad flag of a
// kind, the error names the same flag on every run (the first in the
// documented order), so an operator fixing flags one by one is not sent
// back and forth.
func TestSeveralBadFlagsReportTheSameOne(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"--node-name=n", "--ztunnel-socket=z", "--cni-socket=c", "--run-dir=r", "--admin-socket=a"}, "--ztunnel-socket"},
		{[]string{"--node-name=n", "--health-addr=1", "--metrics-addr=2", "--pprof-addr=3"}, "--health-addr"},
		{[]string{"--node-name=n", "--install-cni", "--cni-poll-interval=1ms", "--cni-resync-interval=1ms", "--cni-repair-window=1ms"}, "--cni-poll-interval"},
	}
	for _, tt := range tests {
		for range 50 {
			_, err := parseRunFlags(tt.args, func(string) string { return "" })
			if err == nil || !strings.HasPrefix(err.Error(), tt.want+" ") {
				t.Fatalf("parseRunFlags(%q) = %v, want an error naming %s first", tt.args, err, tt.want)
			}
		}
	}
}

// TestBadValueKeepsTheRestOfTheEnv: a variable whose value fails to parse
// neither stops the variables after it (AMBIENTD_INSTALL_CNI sorts after
// AMBIENTD_DNS_CAPTURE) from being applied, so the crash-looping agent
// still writes what the plugin needs, nor hides another bad one: every bad
// variable is named, in the same order each time.
func TestBadValueKeepsTheRestOfTheEnv(t *testing.T) {
	vars := map[string]string{"NODE_NAME": "n1", "AMBIENTD_DNS_CAPTURE": "yes", "AMBIENTD_INSTALL_CNI": "true", "AMBIENTD_WORKERS": "many", "AMBIENTD_CNI_BIN_DIR": "/opt/x/bin"}
	var first string
	for range 20 {
		f, err := parseRunFlags(nil, func(k string) string { return vars[k] })
		if err == nil {
			t.Fatal("bad values accepted")
		}
		for _, v := range []string{"AMBIENTD_DNS_CAPTURE", "AMBIENTD_WORKERS"} {
			if !strings.Contains(err.Error(), v) {
				t.Errorf("error %q does not name %s", err, v)
			}
		}
		if first == "" {
			first = err.Error()
		} else if err.Error() != first {
			t.Fatalf("the error changed between runs: %q, then %q", first, err)
		}
		if !f.installCNI || f.install.binDir != "/opt/x/bin" {
			t.Fatalf("the install settings after the bad value were not applied: install-cni %v, bin dir %q", f.installCNI, f.install.binDir)
		}
	}
}

// TestEveryBadValueIsNamed: two flags and two variables that fail to
// parse, and a value a package refuses, are all named in one error — not
// the first of them — in the same order each time: the command line's in
// its order, the variables' by flag name, then the packages' refusals.
func TestEveryBadValueIsNamed(t *testing.T) {
	args := []string{"--node-name=n1", "--kube-qps=fast", "--ztunnel-grace=soon", "--workers=0"}
	vars := map[string]string{"AMBIENTD_DNS_CAPTURE": "yes", "AMBIENTD_ZTUNNEL_ALLOWED_UIDS": "root"}
	want := []string{`--kube-qps "fast"`, `--ztunnel-grace "soon"`, `AMBIENTD_DNS_CAPTURE="yes"`, `AMBIENTD_ZTUNNEL_ALLOWED_UIDS="root"`, "--workers 0"}
	var first string
	for range 10 {
		_, err := parseRunFlags(args, func(k string) string { return vars[k] })
		if err == nil {
			t.Fatal("bad values accepted")
		}
		rest := err.Error()
		for _, w := range want {
			i := strings.Index(rest, w)
			if i < 0 {
				t.Fatalf("error %q does not name %s after the ones before it", err, w)
			}
			rest = rest[i+len(w):]
		}
		if first == "" {
			first = err.Error()
		} else if err.Error() != first {
			t.Fatalf("the error changed between runs: %q, then %q", first, err)
		}
	}
}
