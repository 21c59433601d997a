package nodeready

import (
	"flag"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/settings"
)

// TestRegisterFlags: the node readiness settings as `ambientd run` reads
// them (flags, their variables), validated, each error naming the flag.
func TestRegisterFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    Config
		wantErr string
	}{
		{name: "defaults", want: Config{NodeName: "n1", ConditionType: DefaultConditionType,
			TaintKey: DefaultTaintKey, TaintGracePeriod: 30 * time.Second, ResyncPeriod: 10 * time.Second, HeartbeatPeriod: 5 * time.Minute, Settle: 5 * time.Second}},
		{name: "flags",
			args: []string{"--untaint", "--taint-key=ambientd.io/mesh-not-ready", "--taint-when-unready", "--taint-grace-period=2s",
				"--node-condition-type=example.com/Meshed", "--node-condition-resync=1s", "--node-condition-heartbeat=30s", "--node-condition-settle=0"},
			want: Config{NodeName: "n1", ConditionType: "example.com/Meshed", Untaint: true, TaintKey: "ambientd.io/mesh-not-ready",
				TaintWhenUnready: true, TaintGracePeriod: 2 * time.Second, ResyncPeriod: time.Second, HeartbeatPeriod: 30 * time.Second}},
		{name: "env",
			env: map[string]string{"AMBIENTD_UNTAINT": "true", "AMBIENTD_TAINT_KEY": "ambientd.io/mesh-not-ready", "AMBIENTD_TAINT_WHEN_UNREADY": "true",
				"AMBIENTD_TAINT_GRACE_PERIOD": "5s", "AMBIENTD_NODE_CONDITION_TYPE": "example.com/Meshed", "AMBIENTD_NODE_CONDITION_RESYNC": "3s",
				"AMBIENTD_NODE_CONDITION_HEARTBEAT": "2m", "AMBIENTD_NODE_CONDITION_SETTLE": "1s"},
			want: Config{NodeName: "n1", ConditionType: "example.com/Meshed", Untaint: true, TaintKey: "ambientd.io/mesh-not-ready",
				TaintWhenUnready: true, TaintGracePeriod: 5 * time.Second, ResyncPeriod: 3 * time.Second, HeartbeatPeriod: 2 * time.Minute, Settle: time.Second}},
		{name: "flag wins over env", args: []string{"--untaint=false", "--taint-grace-period=1m"},
			env:  map[string]string{"AMBIENTD_UNTAINT": "true", "AMBIENTD_TAINT_GRACE_PERIOD": "5s"},
			want: Config{NodeName: "n1", ConditionType: DefaultConditionType, TaintKey: DefaultTaintKey, TaintGracePeriod: time.Minute, ResyncPeriod: 10 * time.Second, HeartbeatPeriod: 5 * time.Minute, Settle: 5 * time.Second}},
		{name: "bad env", env: map[string]string{"AMBIENTD_UNTAINT": "yes please"}, wantErr: "AMBIENTD_UNTAINT"},
		{name: "bad taint key", args: []string{"--taint-key=not a key"}, wantErr: "--taint-key"},
		// The attack: a key outside the mesh's would let the agent (a
		// compromised node) remove a taint that keeps workloads away.
		{name: "taint key outside the mesh", args: []string{"--taint-key=dedicated"}, wantErr: "mesh's own prefixes"},
		{name: "a device's taint key", env: map[string]string{"AMBIENTD_TAINT_KEY": "nvidia.com/gpu"}, wantErr: "mesh's own prefixes"},
		{name: "bad resync", args: []string{"--node-condition-resync=1ms"}, wantErr: "--node-condition-resync"},
		{name: "bad heartbeat", args: []string{"--node-condition-heartbeat=10ms"}, wantErr: "--node-condition-heartbeat"},
		{name: "zero grace", args: []string{"--taint-grace-period=0s"}, wantErr: "--taint-grace-period"},
		{name: "bad condition type", args: []string{"--node-condition-type=a/b/c"}, wantErr: "--node-condition-type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			var got Config
			got.RegisterFlags(fs)
			err := settings.Parse(fs, tt.args, func(k string) string { return tt.env[k] }, settings.Var)
			if settings.IsUsageError(err) {
				t.Fatal(err)
			}
			got.NodeName = "n1"
			if err == nil {
				err = got.Validate()
			}
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one mentioning %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("config = %+v\n      want %+v", got, tt.want)
			}
		})
	}
	for _, node := range []string{"", "N_1"} {
		var c Config
		c.RegisterFlags(flag.NewFlagSet("test", flag.ContinueOnError))
		c.NodeName = node
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "--node-name") {
			t.Errorf("node name %q: error %v, want one naming --node-name", node, err)
		}
	}
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	new(Config).RegisterFlags(fs)
	if err := settings.Parse(fs, nil, func(string) string { return "" }, settings.Var); err != nil {
		t.Fatal(err)
	}
	if u := fs.Lookup("untaint").Usage; !strings.Contains(u, "(env AMBIENTD_UNTAINT)") {
		t.Errorf("usage %q does not name the env var", u)
	}
}
