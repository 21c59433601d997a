package imagebuild

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func tree(t *testing.T) string {
	t.Helper()
	d := t.TempDir()
	if err := os.MkdirAll(filepath.Join(d, "usr/bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "usr/bin/tool"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(d, "usr/bin/tool"), filepath.Join(d, "usr/bin/tool2")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("tool", filepath.Join(d, "usr/bin/alias")); err != nil {
		t.Fatal(err)
	}
	// A file owned by someone else, with a fresh mtime: the layer must not show either.
	if err := os.WriteFile(filepath.Join(d, "usr/bin/other"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = os.Lchown(filepath.Join(d, "usr/bin/other"), 1234, 1234) // as root; harmless otherwise
	return d
}

func archive(t *testing.T, dir string, epoch time.Time) ([]byte, string) {
	t.Helper()
	img, err := Build(Options{Layers: []Layer{{Dir: dir, Comment: "t"}}, Tag: "example.com/t:v1", Entrypoint: []string{"/usr/bin/tool"}, Epoch: epoch})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	d, err := WriteArchive(&buf, img, "example.com/t:v1", epoch)
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), d.String()
}

func TestReproducibleAndRootOwned(t *testing.T) {
	epoch := time.Unix(1700000000, 0).UTC()
	dir := tree(t)
	a, da := archive(t, dir, epoch)
	// Touch everything: mtimes must not matter.
	now := time.Now()
	_ = filepath.Walk(dir, func(p string, _ os.FileInfo, _ error) error { return os.Chtimes(p, now, now) })
	b, db := archive(t, dir, epoch)
	if da != db || !bytes.Equal(a, b) {
		t.Fatalf("two builds differ: %s vs %s", da, db)
	}
	if _, dc := archive(t, dir, epoch.Add(time.Second)); dc == da {
		t.Fatal("epoch does not reach the image")
	}

	// docker load's format (manifest.json) reads back as the same image.
	path := filepath.Join(t.TempDir(), "img.tar")
	if err := os.WriteFile(path, a, 0o644); err != nil {
		t.Fatal(err)
	}
	img, err := tarball.ImageFromPath(path, nil)
	if err != nil {
		t.Fatalf("docker-archive view: %v", err)
	}
	// docker rebuilds its own manifest; the image ID (config digest) is what matches.
	orig, _ := Build(Options{Layers: []Layer{{Dir: dir, Comment: "t"}}, Tag: "example.com/t:v1", Entrypoint: []string{"/usr/bin/tool"}, Epoch: epoch})
	wantID, _ := orig.ConfigName()
	if got, err := img.ConfigName(); err != nil || got != wantID {
		t.Fatalf("docker-archive view: image ID %s (%v), want %s", got, err, wantID)
	}
	// The OCI layout view (ctr import, podman load) too.
	oci := t.TempDir()
	untar(t, a, oci)
	idx, err := layout.ImageIndexFromPath(oci)
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil || len(m.Manifests) != 1 || m.Manifests[0].Digest.String() != da || m.Manifests[0].Annotations["io.containerd.image.name"] != "example.com/t:v1" {
		t.Fatalf("index.json: %+v %v", m, err)
	}

	layers, _ := img.Layers()
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(epoch) {
			t.Errorf("%s: uid %d gid %d mtime %v", h.Name, h.Uid, h.Gid, h.ModTime)
		}
		if h.Name == "usr/bin/tool2" && (h.Typeflag != tar.TypeLink || h.Linkname != "usr/bin/tool") {
			t.Errorf("hard link not kept: %+v", h)
		}
		if h.Name == "usr/bin/alias" && (h.Typeflag != tar.TypeSymlink || h.Linkname != "tool") {
			t.Errorf("symlink not kept: %+v", h)
		}
	}
	want := []string{"usr/", "usr/bin/", "usr/bin/alias", "usr/bin/other", "usr/bin/tool", "usr/bin/tool2"}
	if len(names) != len(want) {
		t.Fatalf("entries %v, want %v", names, want)
	}
	for i := range want {
		if names[i] != want[i] {
			t.Fatalf("entries %v, want sorted %v", names, want)
		}
	}
}

func untar(t *testing.T, data []byte, dir string) {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, h.Name)
		if h.Typeflag == tar.TypeDir {
			_ = os.MkdirAll(p, 0o755)
			continue
		}
		_ = os.MkdirAll(filepath.Dir(p), 0o755)
		b, _ := io.ReadAll(tr)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
