package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/settings"
)

// statusCmd asks the running agent over its admin socket and prints this
// node's pods and the agent's state.
func statusCmd(args []string) int {
	return runStatus(context.Background(), args, os.Getenv, os.Stdout, os.Stderr)
}

// statusVar names the status flags' variables: the agent's socket's, and
// its own bound's.
func statusVar(name string) string {
	switch name {
	case "admin-socket":
		return settings.Var(name)
	case "timeout":
		return settings.CommandVar("status", name)
	}
	return ""
}

func runStatus(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("ambientd status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("admin-socket", admin.DefaultSocketPath, "the agent's admin socket")
	output := fs.String("o", "table", "output: table or json")
	pod := fs.String("pod", "", "show one pod (NAME or NAMESPACE/NAME) with the live rules of its network namespace")
	timeout := fs.Duration("timeout", 5*time.Second, "give up after this long")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: ambientd status [flags]\n\nAsks the running agent on this node (as root) about its pods.\n\n")
		fs.PrintDefaults()
	}
	switch err := settings.Parse(fs, args, getenv, statusVar); {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case settings.IsUsageError(err):
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "ambientd status: %v\n", err)
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "ambientd status: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if *output != "table" && *output != "json" {
		fmt.Fprintf(stderr, "ambientd status: -o %q: want table or json\n", *output)
		return 2
	}
	if *timeout <= 0 {
		fmt.Fprintf(stderr, "ambientd status: --timeout %v: must be positive\n", *timeout)
		return 2
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	c := admin.NewClient(*socket)

	var v any
	var err error
	if *pod != "" {
		ns, name, ok := strings.Cut(*pod, "/")
		if !ok {
			ns, name = "", *pod
		}
		v, err = c.Pod(ctx, ns, name)
	} else {
		v, err = c.Status(ctx)
	}
	if err != nil {
		fmt.Fprintf(stderr, "ambientd status: %v\n", err)
		return 1
	}
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(v)
		return 0
	}
	switch v := v.(type) {
	case admin.NodeStatus:
		printNodeStatus(stdout, v)
	case admin.PodDetail:
		printPodDetail(stdout, v)
	}
	return 0
}

func printNodeStatus(w io.Writer, st admin.NodeStatus) {
	ready := "yes"
	if len(st.NotReady) > 0 {
		ready = "no: " + strings.Join(st.NotReady, "; ")
	}
	fmt.Fprintf(w, "node:        %s\n", st.Node)
	fmt.Fprintf(w, "agent ready: %s\n", ready)
	fmt.Fprintf(w, "ztunnel:     %d connected, snapshot acked: %s\n", st.Ztunnel.Connections, yesNo(st.Ztunnel.SnapshotAcked))
	fmt.Fprintf(w, "cni plugin:  %s\n", st.Plugin)
	readiness := st.NodeReadiness
	if len(st.Readiness) > 0 {
		readiness += " (" + strings.Join(st.Readiness, "; ") + ")"
	}
	fmt.Fprintf(w, "node ready:  %s\n", readiness)
	fmt.Fprintf(w, "taint:       %s\n", st.Taint)
	if n := st.APIRequestsLastMinute; n != nil {
		fmt.Fprintf(w, "api server:  %d requests in the last minute (%.2f/s)\n", *n, float64(*n)/60)
	}
	fmt.Fprintln(w)

	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tNAME\tPHASE\tANNOTATION\tZTUNNEL ACKED\tGATE\tAGE\tLAST ERROR")
	for _, p := range st.Pods {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Namespace, p.Name, p.Phase, dash(p.Annotation),
			yesNo(p.ZtunnelAcked), gateColumn(p.MissingGate), age(p.Created, st.Time), dash(oneLine(p.LastError)))
	}
	tw.Flush()
}

// gateColumn is the GATE column: "missing" for a pod in the mesh created
// without the readiness gate admission adds (docs/readiness.md).
func gateColumn(missing bool) string {
	if missing {
		return "missing"
	}
	return "-"
}

func printPodDetail(w io.Writer, d admin.PodDetail) {
	p := d.Pod
	fmt.Fprintf(w, "pod:            %s/%s (uid %s)\n", p.Namespace, p.Name, p.UID)
	fmt.Fprintf(w, "phase:          %s\n", p.Phase)
	fmt.Fprintf(w, "annotation:     %s\n", dash(p.Annotation))
	fmt.Fprintf(w, "ztunnel acked:  %s\n", yesNo(p.ZtunnelAcked))
	fmt.Fprintf(w, "gate:           %s\n", gateColumn(p.MissingGate))
	fmt.Fprintf(w, "last error:     %s\n", dash(p.LastError))
	fmt.Fprintf(w, "ips:            %s\n", dash(strings.Join(p.IPs, ", ")))
	fmt.Fprintf(w, "netns:          %s\n\n", dash(p.Netns))
	if d.RulesError != "" {
		fmt.Fprintf(w, "live rules: unavailable: %s\n", d.RulesError)
		return
	}
	fmt.Fprintf(w, "live rules:\n%s", d.Rules)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// age renders now-t like kubectl: 45s, 12m, 3h, 2d.
func age(t, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := max(now.Sub(t), 0)
	switch {
	case d < 2*time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < 2*time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}
