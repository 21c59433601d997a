package nodeenv

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Images of the node environment. They exist only in the node's containerd
// (imported with ctr, never pushed): pods must use imagePullPolicy: Never.
const (
	// PauseImage is containerd's sandbox_image.
	PauseImage = "ambientd.local/e2e/pause:1"
	// AppImage serves HTTP on :8080 (/healthz for readiness probes, / says
	// hello); see test/infra/nodeenv/images/httpapp.
	AppImage = "ambientd.local/e2e/httpapp:1"
	// AppPort is the port AppImage listens on.
	AppPort = 8080
	// ProxyImage stands in for Istio's istio-proxy in sidecar-mode tests
	// (see test/infra/nodeenv/images/proxy): listeners on 15001 and 15006
	// that answer with where a connection landed, health on 15021.
	ProxyImage = "ambientd.local/e2e/istio-proxy:1"
	// ValidationImage is our istio-validation (test/sidecar-validation), the
	// injected istio-validation init container's stand-in.
	ValidationImage = "ambientd.local/e2e/sidecar-validation:1"
)

// imageSpec is one image built from a main package of this module: a single
// static binary at /<binary>, which is the entrypoint.
type imageSpec struct {
	ref    string
	pkg    string // main package, relative to the repository root
	binary string
}

var nodeImages = []imageSpec{
	{ref: PauseImage, pkg: "./test/infra/nodeenv/images/pause", binary: "pause"},
	{ref: AppImage, pkg: "./test/infra/nodeenv/images/httpapp", binary: "httpapp"},
	{ref: ProxyImage, pkg: "./test/infra/nodeenv/images/proxy", binary: "proxy"},
	{ref: ValidationImage, pkg: "./test/sidecar-validation", binary: "sidecar-validation"},
}

// buildImages compiles each image's binary and writes it as a docker-archive
// tarball (what `ctr images import` reads) into dir; it returns the tarballs.
func buildImages(ctx context.Context, root, dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var tars []string
	for _, spec := range nodeImages {
		bin := filepath.Join(dir, spec.binary)
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, spec.pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("build image %s: go build %s: %w: %s", spec.ref, spec.pkg, err, bytes.TrimSpace(out))
		}
		content, err := os.ReadFile(bin)
		if err != nil {
			return nil, err
		}
		out := filepath.Join(dir, spec.binary+".tar")
		if err := writeImage(out, spec.ref, spec.binary, content); err != nil {
			return nil, fmt.Errorf("build image %s: %w", spec.ref, err)
		}
		tars = append(tars, out)
	}
	return tars, nil
}

// writeImage writes a one-layer image whose only file is /<binary> (mode
// 0755), the entrypoint, as a docker-archive tarball tagged ref.
func writeImage(path, ref, binary string, content []byte) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("image reference %q: %w", ref, err)
	}
	layerTar, err := singleFileTar(binary, content)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return fmt.Errorf("layer: %w", err)
	}
	// Config first, layers after: AppendLayers adds the layer's diff id to
	// this config's rootfs.
	img, err := mutate.ConfigFile(empty.Image, &v1.ConfigFile{
		Architecture: runtime.GOARCH,
		OS:           "linux",
		Created:      v1.Time{Time: time.Unix(0, 0).UTC()},
		Config: v1.Config{
			Entrypoint: []string{"/" + binary},
			Env:        []string{"PATH=/"},
		},
		RootFS: v1.RootFS{Type: "layers"},
	})
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if img, err = mutate.AppendLayers(img, layer); err != nil {
		return fmt.Errorf("append layer: %w", err)
	}
	if err := tarball.WriteToFile(path, tag, img); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

func singleFileTar(name string, content []byte) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{
		Name: name, Mode: 0o755, Size: int64(len(content)), Typeflag: tar.TypeReg,
		ModTime: time.Unix(0, 0),
	}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(content); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// importImages loads the tarballs into containerd's k8s.io namespace (the
// CRI's) and unpacks them for its default snapshotter.
func importImages(ctx context.Context, ctr, address string, tars []string) error {
	for _, t := range tars {
		out, err := exec.CommandContext(ctx, ctr, "--address", address, "--namespace", "k8s.io", "images", "import", t).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ctr images import %s: %w: %s", t, err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}
