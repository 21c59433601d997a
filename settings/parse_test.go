package settings

import (
	"flag"
	"io"
	"os"
	"strings"
	"testing"
	"time"
)

// TestParse: the one flag and variable reader every command parses with.
func TestParse(t *testing.T) {
	varOf := func(name string) string {
		if name == "quiet" {
			return "" // a flag without a variable
		}
		return CommandVar("t", name)
	}
	tests := []struct {
		name    string
		args    []string
		vars    map[string]string
		socket  string
		timeout time.Duration
		verbose bool
		wantErr []string // each in the error, in this order; nil = none
	}{
		{name: "defaults", socket: "/default.sock", timeout: 5 * time.Second},
		{name: "env over default", vars: map[string]string{"AMBIENTD_T_SOCKET": "/env.sock", "AMBIENTD_T_TIMEOUT": "1m", "AMBIENTD_T_VERBOSE": "true"},
			socket: "/env.sock", timeout: time.Minute, verbose: true},
		{name: "flag over env", args: []string{"--socket=/flag.sock", "--verbose=false"}, vars: map[string]string{"AMBIENTD_T_SOCKET": "/env.sock", "AMBIENTD_T_VERBOSE": "true"},
			socket: "/flag.sock", timeout: 5 * time.Second},
		{name: "flag equal to the default still wins", args: []string{"--timeout=5s"}, vars: map[string]string{"AMBIENTD_T_TIMEOUT": "1m"},
			socket: "/default.sock", timeout: 5 * time.Second},
		{name: "empty variable is unset", vars: map[string]string{"AMBIENTD_T_SOCKET": ""}, socket: "/default.sock", timeout: 5 * time.Second},
		{name: "a flag without a variable is not read from one", vars: map[string]string{"AMBIENTD_T_QUIET": "true"}, socket: "/default.sock", timeout: 5 * time.Second},
		{name: "bad env value names the variable, the value and the flag", vars: map[string]string{"AMBIENTD_T_TIMEOUT": "soon"},
			wantErr: []string{`AMBIENTD_T_TIMEOUT="soon" (for --timeout): want a duration`}},
		{name: "bad boolean", vars: map[string]string{"AMBIENTD_T_VERBOSE": "maybe"}, wantErr: []string{`AMBIENTD_T_VERBOSE="maybe" (for --verbose): want true or false`}},
		{name: "bad value on the command line", args: []string{"--timeout=soon"}, wantErr: []string{`--timeout "soon": want a duration`}},
		{name: "a bad variable of a flag given is never read", args: []string{"--timeout=2s"}, vars: map[string]string{"AMBIENTD_T_TIMEOUT": "soon"},
			socket: "/default.sock", timeout: 2 * time.Second},
		// Every bad value is named, not the first: the command line's in
		// their order, then the variables' by flag name; the good values
		// among them take effect.
		{name: "two bad flags and two bad variables",
			args:    []string{"--verbose=maybe", "--socket=/flag.sock", "--timeout", "soon"},
			vars:    map[string]string{"AMBIENTD_T_COUNT": "many", "AMBIENTD_T_RATE": "fast", "AMBIENTD_T_SOCKET": "/env.sock"},
			socket:  "/flag.sock",
			wantErr: []string{`--verbose "maybe"`, `--timeout "soon"`, `AMBIENTD_T_COUNT="many" (for --count): want an integer`, `AMBIENTD_T_RATE="fast" (for --rate): want a number`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("t", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			socket := fs.String("socket", "/default.sock", "the socket")
			timeout := fs.Duration("timeout", 5*time.Second, "the timeout")
			verbose := fs.Bool("verbose", false, "say more")
			fs.Bool("quiet", false, "say less")
			fs.Int("count", 1, "how many")
			fs.Float64("rate", 1, "how fast")
			err := Parse(fs, tt.args, func(k string) string { return tt.vars[k] }, varOf)
			if tt.wantErr != nil {
				if err == nil {
					t.Fatalf("no error, want one naming %q", tt.wantErr)
				}
				if IsUsageError(err) {
					t.Errorf("%v is a usage error: only the command line's syntax is", err)
				}
				rest := err.Error()
				for _, w := range tt.wantErr {
					i := strings.Index(rest, w)
					if i < 0 {
						t.Fatalf("error %q does not name %q (after the ones before it)", err, w)
					}
					rest = rest[i+len(w):]
				}
				if *socket != tt.socket && tt.socket != "" {
					t.Errorf("socket %q, want %q: a good value beside bad ones is applied", *socket, tt.socket)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if *socket != tt.socket || *timeout != tt.timeout || *verbose != tt.verbose {
				t.Errorf("got socket %q timeout %v verbose %v; want %q %v %v", *socket, *timeout, *verbose, tt.socket, tt.timeout, tt.verbose)
			}
			if u := fs.Lookup("timeout").Usage; u != "the timeout (env AMBIENTD_T_TIMEOUT)" {
				t.Errorf("usage %q does not name the variable", u)
			}
		})
	}
}

// TestParseUsage: an unknown flag is a usage error, printed with the
// usage; -h is flag.ErrHelp; both print the flags' real types and
// defaults (the values are wrapped only while parsing).
func TestParseUsage(t *testing.T) {
	for _, args := range [][]string{{"--nope"}, {"-h"}} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		var out strings.Builder
		fs.SetOutput(&out)
		fs.Duration("timeout", 5*time.Second, "the timeout")
		fs.Bool("verbose", false, "say more")
		err := Parse(fs, args, os.Getenv, nil)
		if args[0] == "-h" {
			if err != flag.ErrHelp {
				t.Errorf("-h: %v, want flag.ErrHelp", err)
			}
		} else if !IsUsageError(err) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
		if !strings.Contains(out.String(), "-timeout duration") || !strings.Contains(out.String(), "(default 5s)") || strings.Contains(out.String(), "(default false)") {
			t.Errorf("%v: usage\n%s\nwant the flags' types and defaults as the flag package prints them", args, out.String())
		}
	}
}

func TestVar(t *testing.T) {
	for name, want := range map[string]string{
		"ztunnel-grace": "AMBIENTD_ZTUNNEL_GRACE", "cni-plugin-token-ttl": "AMBIENTD_CNI_PLUGIN_TOKEN_TTL", "ipv6": "AMBIENTD_IPV6",
		"node-name": "NODE_NAME", "ztunnel-socket": "ZTUNNEL_UDS_ADDRESS", "kubeconfig": "KUBECONFIG", "daemonset-namespace": "POD_NAMESPACE",
	} {
		if got := Var(name); got != want {
			t.Errorf("Var(%q) = %q, want %q", name, got, want)
		}
	}
	if got := CommandVar("bundle", "max-file-bytes"); got != "AMBIENTD_BUNDLE_MAX_FILE_BYTES" {
		t.Errorf("CommandVar = %q", got)
	}
}

func TestValues(t *testing.T) {
	var (
		list []string
		uids []uint32
	)
	if err := (List{&list}).Set(" a, b ,,"); err != nil || strings.Join(list, ",") != "a,b" {
		t.Errorf("list %q, %v", list, err)
	}
	if err := (UIDs{&uids}).Set("0, 1337"); err != nil || len(uids) != 2 || uids[1] != 1337 {
		t.Errorf("uids %v, %v", uids, err)
	}
	for _, bad := range []string{"root", ",", ""} {
		if err := (UIDs{&uids}).Set(bad); err == nil {
			t.Errorf("uids %q accepted", bad)
		}
	}
	var m os.FileMode
	if err := (FileMode{&m}).Set("0660"); err != nil || m != 0o660 || (FileMode{&m}).String() != "0660" {
		t.Errorf("mode %v, %v", m, err)
	}
	for _, bad := range []string{"0066", "rw", "01777"} {
		if err := (FileMode{&m}).Set(bad); err == nil {
			t.Errorf("mode %q accepted", bad)
		}
	}
	var d time.Duration
	for _, bad := range []string{"0", "-1s", "soon"} {
		if err := (Positive{&d}).Set(bad); err == nil {
			t.Errorf("positive duration %q accepted", bad)
		}
	}
}
