package main

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

// TestParseFlags: the one env→flag binder every subcommand parses with.
func TestParseFlags(t *testing.T) {
	env := flagEnv{"socket": "T_SOCKET", "timeout": "T_TIMEOUT", "verbose": "T_VERBOSE"}
	tests := []struct {
		name    string
		args    []string
		vars    map[string]string
		socket  string
		timeout time.Duration
		verbose bool
		wantErr string // "" = none
	}{
		{name: "defaults", socket: "/default.sock", timeout: 5 * time.Second},
		{name: "env over default", vars: map[string]string{"T_SOCKET": "/env.sock", "T_TIMEOUT": "1m", "T_VERBOSE": "true"},
			socket: "/env.sock", timeout: time.Minute, verbose: true},
		{name: "flag over env", args: []string{"--socket=/flag.sock", "--verbose=false"}, vars: map[string]string{"T_SOCKET": "/env.sock", "T_VERBOSE": "true"},
			socket: "/flag.sock", timeout: 5 * time.Second},
		{name: "flag equal to the default still wins", args: []string{"--timeout=5s"}, vars: map[string]string{"T_TIMEOUT": "1m"},
			socket: "/default.sock", timeout: 5 * time.Second},
		{name: "empty variable is unset", vars: map[string]string{"T_SOCKET": ""}, socket: "/default.sock", timeout: 5 * time.Second},
		{name: "bad env value names the variable and the flag", vars: map[string]string{"T_TIMEOUT": "soon"}, wantErr: "T_TIMEOUT (for --timeout): "},
		{name: "bad boolean", vars: map[string]string{"T_VERBOSE": "maybe"}, wantErr: "T_VERBOSE (for --verbose)"},
		{name: "bad value on the command line", args: []string{"--timeout=soon"}, wantErr: "invalid value"},
		{name: "a bad variable of a flag given is never read", args: []string{"--timeout=2s"}, vars: map[string]string{"T_TIMEOUT": "soon"},
			socket: "/default.sock", timeout: 2 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("t", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			socket := fs.String("socket", "/default.sock", "the socket")
			timeout := fs.Duration("timeout", 5*time.Second, "the timeout")
			verbose := fs.Bool("verbose", false, "say more")
			err := parseFlags(fs, tt.args, func(k string) string { return tt.vars[k] }, env)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				if isParseError(err) != (len(tt.args) > 0 && tt.vars == nil) {
					t.Errorf("isParseError(%v) = %v: only command-line errors are parse errors", err, isParseError(err))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if *socket != tt.socket || *timeout != tt.timeout || *verbose != tt.verbose {
				t.Errorf("got socket %q timeout %v verbose %v; want %q %v %v", *socket, *timeout, *verbose, tt.socket, tt.timeout, tt.verbose)
			}
			if u := fs.Lookup("timeout").Usage; u != "the timeout (env T_TIMEOUT)" {
				t.Errorf("usage %q does not name the variable", u)
			}
		})
	}
}

// TestEnvTablesAgree: across every subcommand, a variable sets one flag and
// a flag is set by one variable (uninstall reads --iptables as run does).
func TestEnvTablesAgree(t *testing.T) {
	tables := map[string]flagEnv{"run": envOf, "install": installEnvOf, "node readiness": nodeReadyEnvOf, "sidecar": sidecarEnvOf,
		"uninstall": uninstallEnvOf, "status": statusEnvOf, "inject/check": settingsEnvOf}
	flagOf, varOf := map[string]string{}, map[string]string{}
	for table, env := range tables {
		for name, v := range env {
			if f, ok := flagOf[v]; ok && f != name {
				t.Errorf("%s: %s sets --%s here, --%s elsewhere", table, v, name, f)
			}
			flagOf[v] = name
			// --timeout is each command's own bound.
			if w, ok := varOf[name]; ok && w != v && name != "timeout" {
				t.Errorf("%s: --%s is set by %s here, by %s elsewhere", table, name, v, w)
			}
			varOf[name] = v
		}
	}
}
