package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/bundle"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/settings"
)

// bundleCmd writes one archive for a support ticket (nodeagent/bundle).
func bundleCmd(args []string) int {
	return runBundle(context.Background(), args, os.Getenv, os.Environ(), os.Stdout, os.Stderr)
}

// bundleVar names the bundle's variables: its own flags' (-o's
// AMBIENTD_BUNDLE_OUTPUT).
func bundleVar(name string) string {
	if name == "o" {
		name = "output"
	}
	return settings.CommandVar("bundle", name)
}

func runBundle(ctx context.Context, args []string, getenv func(string) string, environ []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("ambientd bundle", flag.ContinueOnError)
	fs.SetOutput(stderr)
	output := fs.String("o", "", "the archive to write; - for stdout (default /tmp/ambientd-bundle-NODE-TIME.tar.gz)")
	maxFile := fs.Int64("max-file-bytes", bundle.DefaultLimits.MaxFileBytes, "cap of each file in the archive (uncompressed); a longer one is cut and says so")
	maxTotal := fs.Int64("max-total-bytes", bundle.DefaultLimits.MaxTotalBytes, "cap of all files together (uncompressed); files past it are left out and named in MANIFEST.txt")
	timeout := fs.Duration("timeout", time.Minute, "give up collecting after this long (each request: at most 10s)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: ambientd bundle [-o FILE|-] [flags] [-- AGENT FLAGS...]\n\n"+
			"Writes one tar.gz for a support ticket: version, the agent's settings as parsed (its variables, or\n"+
			"the flags after --), the status of every pod on this node (admin socket, root), the CNI dirs and the\n"+
			"install lease, the rules, the agent's errors, the node's Events and the agent's metrics. Credentials\n"+
			"are never collected: kubeconfigs are not read, tokens and secrets are redacted.\n\n")
		fs.PrintDefaults()
	}
	bundleArgs, agentArgs := args, []string(nil)
	if i := slices.Index(args, "--"); i >= 0 {
		bundleArgs, agentArgs = args[:i], args[i+1:]
	}
	switch err := settings.Parse(fs, bundleArgs, getenv, bundleVar); {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case settings.IsUsageError(err):
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "ambientd bundle: %v\n", err)
		return 2
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "ambientd bundle: unexpected argument %q (the agent's flags go after --)\n", fs.Arg(0))
		return 2
	case *maxFile < 1024 || *maxTotal < *maxFile:
		fmt.Fprintf(stderr, "ambientd bundle: --max-file-bytes %d, --max-total-bytes %d: want at least 1024, and the total at least a file's\n", *maxFile, *maxTotal)
		return 2
	case *timeout <= 0:
		fmt.Fprintf(stderr, "ambientd bundle: --timeout %v: must be positive\n", *timeout)
		return 2
	}
	f, settings, err := agentSettings(agentArgs, getenv, stderr)
	if err != nil {
		return 2 // a command-line error in the agent's flags, printed
	}
	now := time.Now()
	node := f.node.Agent.NodeName
	dir := "ambientd-bundle-" + strings.Trim(bundleSafe(node)+"-"+now.UTC().Format("20060102T150405Z"), "-")

	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	var out io.Writer = stdout
	path := *output
	if path == "" {
		path = filepath.Join(os.TempDir(), dir+".tar.gz")
	}
	var file *os.File
	if path != "-" {
		// 0600: the bundle describes the node; its owner decides who reads it.
		if file, err = os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600); err != nil {
			fmt.Fprintf(stderr, "ambientd bundle: %v\n", err)
			return 1
		}
		out = file
	}
	a := bundle.NewArchive(out, dir, bundle.Limits{MaxFileBytes: *maxFile, MaxTotalBytes: *maxTotal}, now)
	src := agentSources(f, settings, environ, now)
	if restCfg, err := kubeConfig(f.kubeconfig); err != nil {
		a.Note("API: %v", err)
	} else {
		restCfg.UserAgent = "ambientd/" + version
		if src.Client, err = kube.NewForConfig(restCfg); err != nil {
			a.Note("API: %v", err)
		}
	}
	bundle.Collect(ctx, a, src)
	err = a.Close()
	if file != nil {
		if cerr := file.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(path)
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "ambientd bundle: %v\n", err)
		return 1
	}
	if path != "-" {
		fmt.Fprintf(stderr, "ambientd bundle: wrote %s\n", path)
	}
	return 0
}

// agentSources is what the bundle collects of the agent with settings f:
// the files made here (version, settings, variables, rules) and where the
// rest is found.
func agentSources(f runFlags, settings []byte, environ []string, now time.Time) bundle.Sources {
	node := f.node.Agent.NodeName
	return bundle.Sources{
		Files: []bundle.File{
			{Name: "version.txt", Data: versionText(now, node)},
			{Name: "settings.txt", Data: settings},
			{Name: "env.txt", Data: envText(environ)},
			{Name: "rules/pod-rules.txt", Data: rulesText(f, false)},
			{Name: "rules/host-rules.txt", Data: rulesText(f, true)},
		},
		AdminSocket: f.node.AdminSocket,
		CNIConfDir:  f.install.confDir, CNIBinDir: f.install.binDir, PluginName: cniapi.PluginType,
		MetricsAddr: f.node.MetricsAddr,
		NodeName:    node,
	}
}

func bundleSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '-' || r == '.' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, s)
}

// runVars is every variable of the agent's settings, by flag.
func runVars() map[string]string {
	var f runFlags
	all := map[string]string{}
	f.flagSet().VisitAll(func(fl *flag.Flag) { all[fl.Name] = settings.Var(fl.Name) })
	return all
}

// notCredentials are settings whose names match bundle.SecretName but
// whose values are no credential (a token's lifetime).
var notCredentials = map[string]bool{"cni-plugin-token-ttl": true}

// agentSettings parses the agent's settings as `ambientd run` does (its
// flags, then its variables) and renders every one with where it came
// from; a value named for or looking like a credential is redacted. The
// settings are also validated as `ambientd run` validates them.
func agentSettings(args []string, getenv func(string) string, stderr io.Writer) (runFlags, []byte, error) {
	var f runFlags
	fs := f.flagSet()
	fs.SetOutput(stderr)
	if err := settings.Parse(fs, args, getenv, settings.Var); settings.IsUsageError(err) || errors.Is(err, flag.ErrHelp) {
		return f, nil, err
	}
	// settings.Parse sets flags from variables too: what the command line
	// gave is read from args.
	given := map[string]bool{}
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
			given[name] = true
		}
	}
	env := runVars()
	var b bytes.Buffer
	fmt.Fprintf(&b, "# the agent's settings as `ambientd run` parses them here (flags after --, then variables, then defaults)\n")
	fs.VisitAll(func(fl *flag.Flag) {
		source := "default"
		switch v, ok := env[fl.Name]; {
		case given[fl.Name]:
			source = "flag"
		case ok && getenv(v) != "":
			source = "env " + v
		}
		value := fl.Value.String()
		if bundle.SecretName(fl.Name) && !notCredentials[fl.Name] || bundle.LooksSecret(value) {
			value = bundle.Redacted
		}
		fmt.Fprintf(&b, "--%s=%s\t(%s)\n", fl.Name, strconv.Quote(value), source)
	})
	if _, err := parseRunFlags(args, getenv); err != nil {
		fmt.Fprintf(&b, "\nthe agent would refuse these settings: %v\n", err)
	} else {
		b.WriteString("\nthe agent accepts these settings\n")
	}
	return f, b.Bytes(), nil
}

// envText lists the agent's variables with their values (a credential's
// redacted) and the names only of every other variable.
func envText(environ []string) []byte {
	ours := map[string]bool{}
	for _, v := range runVars() {
		ours[v] = true
	}
	var mine, others []string
	for _, kv := range environ {
		name, value, _ := strings.Cut(kv, "=")
		switch {
		case !ours[name]:
			others = append(others, name)
		case bundle.SecretName(name) || bundle.LooksSecret(value):
			mine = append(mine, name+"="+bundle.Redacted)
		default:
			mine = append(mine, name+"="+strconv.Quote(value))
		}
	}
	slices.Sort(mine)
	slices.Sort(others)
	var b bytes.Buffer
	b.WriteString("# the agent's variables (KUBECONFIG is a path: the file is not read)\n")
	for _, l := range mine {
		b.WriteString(l + "\n")
	}
	b.WriteString("\n# other variables, names only\n")
	for _, n := range others {
		b.WriteString(n + "\n")
	}
	return b.Bytes()
}

// versionText is the build and the host.
func versionText(now time.Time, node string) []byte {
	host, _ := os.Hostname()
	return fmt.Appendf(nil, "ambientd %s\ngo %s %s/%s\ntime %s\nnode %s\nhostname %s\n",
		version, runtime.Version(), runtime.GOOS, runtime.GOARCH, now.UTC().Format(time.RFC3339), node, host)
}

// rulesText is what `ambientd rules` prints for the agent's settings: the
// in-pod rules a pod without annotations gets, or the host's probe rules.
func rulesText(f runFlags, host bool) []byte {
	args := []string{"--ipv6=" + strconv.FormatBool(f.rules.IPv6), "--dns-capture=" + strconv.FormatBool(f.node.Agent.DNSCapture)}
	for _, ri := range f.rules.RerouteInterfaces {
		args = append(args, "--reroute-interface="+ri)
	}
	if f.rules.Mode == iptables.ModeNFTables {
		args = append(args, "--nftables")
	}
	if host {
		args = append(args, "--host")
	}
	var out, errb bytes.Buffer
	fmt.Fprintf(&out, "# ambientd rules %s\n", strings.Join(args, " "))
	if code := runRules(args, &out, &errb); code != 0 {
		fmt.Fprintf(&out, "ambientd rules: exit %d: %s", code, errb.String())
	}
	return out.Bytes()
}
