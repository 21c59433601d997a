package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/check"
	"github.com/ambientd/ambientd/admission/inject"
	"github.com/ambientd/ambientd/podmeta"
)

// injectCmd adds the readiness gate to the pod templates of manifests that
// the mesh will enroll (admission/inject): what the shipped admission policy
// does, offline.
func injectCmd(args []string) int {
	return runInject(context.Background(), args, os.Getenv, os.Stdin, os.Stdout, os.Stderr)
}

func runInject(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("ambientd inject", flag.ContinueOnError)
	fs.SetOutput(stderr)
	file := fs.String("f", "-", "manifest file (YAML documents or JSON; - = stdin)")
	out := fs.String("o", "-", "write here (- = stdout)")
	namespace := fs.String("n", "", "namespace of documents that name none (default: the kubeconfig context's with --cluster, else default)")
	ambient := fs.String("ambient-namespaces", "", "comma-separated namespaces to treat as labelled istio.io/dataplane-mode=ambient (when neither the input nor --cluster says)")
	cluster := fs.Bool("cluster", false, "read namespace labels and the agent's settings (ConfigMap ambientd-config) from the cluster")
	agentNS := fs.String("agent-namespace", admission.DefaultAgentNamespace, "with --cluster: the agent's namespace")
	var cf clientFlags
	cf.register(fs)
	var sf settingsFlags
	sf.register(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: ambientd inject [-f FILE] [flags] > injected.yaml\n\n"+
			"Adds {conditionType: %s} to spec.readinessGates of the pod templates (%s) that the\n"+
			"ambient mesh will enroll, as the admission policy does; everything else is written back unchanged.\n\n",
			podmeta.ConditionEnrolled, strings.Join(inject.Kinds(), ", "))
		fs.PrintDefaults()
	}
	if code, ok := parseClientFlags(fs, args, &sf, getenv, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "ambientd inject: unexpected argument %q (use -f)\n", fs.Arg(0))
		return 2
	}
	known := map[string]map[string]string{}
	for _, n := range strings.Split(*ambient, ",") {
		if n = strings.TrimSpace(n); n != "" {
			known[n] = map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
		}
	}
	opts := inject.Options{
		Settings:  sf.settings(admission.DefaultSettings()),
		Namespace: *namespace,
		NamespaceLabels: func(ns string) (map[string]string, bool) {
			l, ok := known[ns]
			return l, ok
		},
		Warn: func(m string) { fmt.Fprintf(stderr, "ambientd inject: warning: %s\n", m) },
	}
	if *cluster {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		client, ctxNS, err := cf.client(ctx)
		if err != nil {
			fmt.Fprintf(stderr, "ambientd inject: %v\n", err)
			return 1
		}
		if opts.Namespace == "" {
			opts.Namespace = ctxNS
		}
		c := check.New(ctx, client, check.Options{AgentNamespace: *agentNS})
		opts.Settings = sf.settings(c.Settings())
		opts.NamespaceLabels = func(ns string) (map[string]string, bool) {
			if l, ok := known[ns]; ok {
				return l, true
			}
			return c.NamespaceLabels(ctx, ns)
		}
	}
	in, err := openInput(*file, stdin)
	if err != nil {
		fmt.Fprintf(stderr, "ambientd inject: %v\n", err)
		return 1
	}
	defer in.Close()
	// Written only when everything was read and injected: a failure never
	// leaves half a manifest behind.
	var buf strings.Builder
	res, err := inject.Inject(in, &buf, opts)
	if err != nil {
		fmt.Fprintf(stderr, "ambientd inject: %s: %v\n", *file, err)
		return 1
	}
	w := stdout
	if *out != "-" {
		f, err := os.Create(*out)
		if err != nil {
			fmt.Fprintf(stderr, "ambientd inject: %v\n", err)
			return 1
		}
		defer f.Close()
		w = f
	}
	if _, err := io.WriteString(w, buf.String()); err != nil {
		fmt.Fprintf(stderr, "ambientd inject: %v\n", err)
		return 1
	}
	fmt.Fprintf(stderr, "ambientd inject: %d pod templates, gate added to %d\n", len(res.Templates), res.Injected())
	return 0
}
