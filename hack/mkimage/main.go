// Command mkimage writes the agent's image archive from directory trees (see
// hack/imagebuild and hack/image.sh). It prints the image digest.
//
//	mkimage --layer rootfs=DIR --layer ambientd=DIR --tag REF --out FILE
//
// The defaults describe the agent's image; --entrypoint, --cmd, --path and
// --title describe another (hack/istio-agent-image.sh: Istio's node agent on
// the same Debian layer, for the switch tests).
//
// SOURCE_DATE_EPOCH (seconds) sets every timestamp; default 0.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ambientd/ambientd/hack/imagebuild"
)

type layerFlag []imagebuild.Layer

func (l *layerFlag) String() string { return fmt.Sprint(*l) }
func (l *layerFlag) Set(v string) error {
	comment, dir, ok := strings.Cut(v, "=")
	if !ok || dir == "" {
		return fmt.Errorf("layer %q: want comment=dir", v)
	}
	*l = append(*l, imagebuild.Layer{Dir: dir, Comment: comment})
	return nil
}

func main() {
	var layers layerFlag
	fs := flag.NewFlagSet("mkimage", flag.ExitOnError)
	fs.Var(&layers, "layer", "comment=dir, bottom layer first (repeatable)")
	tag := fs.String("tag", "ghcr.io/ambientd/ambientd:dev", "image reference recorded in the archive")
	out := fs.String("out", "", "archive to write")
	version := fs.String("version", "dev", "org.opencontainers.image.version label")
	cfg := imageConfig{}
	fs.StringVar(&cfg.entrypoint, "entrypoint", "/usr/local/bin/ambientd", "the image's entrypoint, comma-separated words (empty: none)")
	fs.StringVar(&cfg.cmd, "cmd", "run", "the image's default arguments, comma-separated words")
	fs.StringVar(&cfg.path, "path", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "the image's PATH")
	fs.StringVar(&cfg.title, "title", "ambientd", "org.opencontainers.image.title label")
	fs.StringVar(&cfg.source, "source", "https://github.com/ambientd/ambientd", "org.opencontainers.image.source label")
	_ = fs.Parse(os.Args[1:])
	if err := run(layers, *tag, *out, *version, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

// imageConfig is the image's run configuration and labels.
type imageConfig struct{ entrypoint, cmd, path, title, source string }

// words splits a comma-separated flag value; empty is none.
func words(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func run(layers []imagebuild.Layer, tag, out, version string, cfg imageConfig) error {
	if out == "" || len(layers) == 0 {
		return fmt.Errorf("--out and at least one --layer are required")
	}
	epoch := time.Unix(0, 0).UTC()
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err)
		}
		epoch = time.Unix(n, 0).UTC()
	}
	img, err := imagebuild.Build(imagebuild.Options{
		Layers:     layers,
		Tag:        tag,
		Entrypoint: words(cfg.entrypoint),
		Cmd:        words(cfg.cmd),
		Env:        []string{"PATH=" + cfg.path},
		Labels: map[string]string{
			"org.opencontainers.image.title":   cfg.title,
			"org.opencontainers.image.version": version,
			"org.opencontainers.image.source":  cfg.source,
		},
		Epoch: epoch,
	})
	if err != nil {
		return err
	}
	tmp := out + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	digest, err := imagebuild.WriteArchive(f, img, tag, epoch)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, out); err != nil {
		return err
	}
	fmt.Println(digest)
	return nil
}
