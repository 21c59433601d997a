// Command ensure builds what a make target needs and is missing (see
// test/infra/build): every make target that runs something calls it first, so
// each works alone on a fresh clone.
//
//	go run ./hack/ensure [-name 'make demo'] TARGET|PART...
//	go run ./hack/ensure -list TARGET
//	go run ./hack/ensure programs -out DIR [-version V] [NAME...]
//
// From the command line it rebuilds bin/ and the image every time (the code
// under test is the tree as it is now); everything else is built only when
// missing, into .cache/.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/ambientd/ambientd/test/infra/build"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if len(os.Args) > 1 && os.Args[1] == "programs" {
		os.Exit(programs(ctx, os.Args[2:]))
	}
	name := flag.String("name", "", "what the user ran, for messages (default: `go run ./hack/ensure TARGET`)")
	list := flag.Bool("list", false, "print what each TARGET needs and exit")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: go run ./hack/ensure [-name NAME] [-list] TARGET|PART...\n\ntargets:")
		for t := range build.Targets {
			fmt.Fprintf(os.Stderr, " %s", t)
		}
		fmt.Fprintln(os.Stderr)
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	var parts []build.Part
	for _, t := range flag.Args() {
		p, err := build.PartsOf(t)
		if err != nil {
			fmt.Fprintf(os.Stderr, "ensure: %v\n", err)
			flag.Usage()
			os.Exit(2)
		}
		if *list {
			ps := make([]string, len(p))
			for i := range p {
				ps[i] = string(p[i])
			}
			fmt.Printf("%s: %s\n", t, strings.Join(ps, " "))
		}
		parts = append(parts, p...)
	}
	if *list {
		return
	}
	if *name == "" {
		*name = "`go run ./hack/ensure " + strings.Join(flag.Args(), " ") + "`"
	}
	if _, err := build.Ensure(ctx, parts, build.Options{Rebuild: true, Name: *name}); err != nil {
		fmt.Fprintf(os.Stderr, "ensure: %v\n", err)
		os.Exit(1)
	}
}

// programs builds our programs into a directory (hack/image.sh).
func programs(ctx context.Context, args []string) int {
	fs := flag.NewFlagSet("programs", flag.ExitOnError)
	out := fs.String("out", "bin", "directory to build into")
	version := fs.String("version", "", "version stamped into the shipped programs")
	fs.Parse(args)
	root, err := build.RepoRoot()
	if err == nil {
		err = build.BuildPrograms(ctx, os.Stderr, root, *out, *version, fs.Args()...)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ensure programs: %v\n", err)
		return 1
	}
	return 0
}
