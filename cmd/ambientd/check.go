package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"github.com/ambientd/ambientd/podmeta"
	"io"
	"os"
	"strings"
	"time"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/check"
	"github.com/ambientd/ambientd/breakers"
)

// checkCmd explains, through the API only, whether pods are (or will be) in
// the mesh and gated, what decided it, and what the agent shows for them
// (admission/check).
func checkCmd(args []string) int {
	return runCheck(context.Background(), args, os.Getenv, os.Stdin, os.Stdout, os.Stderr)
}

func runCheck(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("ambientd check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	namespace := fs.String("n", "", "namespace (default: the kubeconfig context's)")
	all := fs.Bool("A", false, "every namespace")
	file := fs.String("f", "", "check the pod templates of this manifest instead of existing pods (- = stdin)")
	output := fs.String("o", "table", "output: table or json")
	agentNS := fs.String("agent-namespace", admission.DefaultAgentNamespace, "the agent's namespace (its ConfigMap and DaemonSet pods)")
	agentSel := fs.String("agent-selector", check.DefaultAgentSelector, "label selector of the agent's pods")
	timeout := fs.Duration("timeout", 30*time.Second, "give up after this long")
	clusterBreakers := fs.Bool("cluster-breakers", false, "instead of pods, name the cluster's settings under which ambient capture silently fails (Cilium, Calico) and their fixes; exit 3 when one is found")
	var cf clientFlags
	cf.register(fs)
	var sf settingsFlags
	sf.register(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: ambientd check [POD...] [-n NAMESPACE | -A] [-f MANIFEST] [-o table|json]\n"+
			"       ambientd check --cluster-breakers [-o table|json]\n\n"+
			"Says for each pod (all of the namespace when none is named) or each pod template of a manifest whether\n"+
			"it is (will be) in the ambient mesh and gated on %s, which label decided it, the agent's\n"+
			"annotation and condition, and whether an agent serves its node. With --cluster-breakers it names the\n"+
			"CNI settings under which capture silently fails instead. Needs only a kubeconfig.\n\n", podmeta.ConditionEnrolled)
		fs.PrintDefaults()
	}
	if code, ok := parseClientFlags(fs, args, &sf, getenv, stderr); !ok {
		return code
	}
	names := fs.Args()
	for i, n := range names {
		names[i] = strings.TrimPrefix(strings.TrimPrefix(n, "pod/"), "pods/")
	}
	switch {
	case *output != "table" && *output != "json":
		fmt.Fprintf(stderr, "ambientd check: -o %q: want table or json\n", *output)
		return 2
	case *file != "" && len(names) > 0:
		fmt.Fprintf(stderr, "ambientd check: pod names and -f exclude each other\n")
		return 2
	case *all && (len(names) > 0 || *namespace != ""):
		fmt.Fprintf(stderr, "ambientd check: -A excludes pod names and -n\n")
		return 2
	case *clusterBreakers && (len(names) > 0 || *file != "" || *all):
		fmt.Fprintf(stderr, "ambientd check: --cluster-breakers excludes pod names, -f and -A\n")
		return 2
	case *timeout <= 0:
		fmt.Fprintf(stderr, "ambientd check: --timeout %v: must be positive\n", *timeout)
		return 2
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	client, ctxNS, err := cf.client(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "ambientd check: %v\n", err)
		return 1
	}
	if *clusterBreakers {
		return writeBreakers(breakers.Find(ctx, client, client), *output, stdout, stderr)
	}
	ns := *namespace
	if ns == "" && !*all {
		ns = ctxNS
	}
	c := check.New(ctx, client, check.Options{AgentNamespace: *agentNS, AgentSelector: *agentSel})
	c.Override(sf.settings(c.Settings()))
	var rep check.Report
	if *file != "" {
		in, oerr := openInput(*file, stdin)
		if oerr != nil {
			fmt.Fprintf(stderr, "ambientd check: %v\n", oerr)
			return 1
		}
		defer in.Close()
		rep, err = c.Manifest(ctx, in, ns)
	} else {
		rep, err = c.Pods(ctx, ns, names)
	}
	if err != nil {
		fmt.Fprintf(stderr, "ambientd check: %v\n", err)
		return 1
	}
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(rep)
	} else {
		err = check.WriteTable(stdout, rep)
	}
	if err != nil {
		fmt.Fprintf(stderr, "ambientd check: %v\n", err)
		return 1
	}
	return 0
}

// writeBreakers prints the cluster breakers report; exit 3 when one is
// found, so a pipeline can stop on it.
func writeBreakers(rep breakers.Report, output string, stdout, stderr io.Writer) int {
	var err error
	if output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(rep)
	} else {
		err = breakers.WriteTable(stdout, rep)
	}
	if err != nil {
		fmt.Fprintf(stderr, "ambientd check: %v\n", err)
		return 1
	}
	if rep.Breakers() > 0 {
		return 3
	}
	return 0
}
