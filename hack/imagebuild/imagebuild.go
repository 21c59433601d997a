// Package imagebuild assembles a container image from directory trees,
// reproducibly and without a container engine: every file is owned by root,
// every timestamp is the given epoch, entries are sorted, and the result is
// written as one tar that is both an OCI image layout (for `ctr images
// import`, `podman load`) and a docker archive (manifest.json, for `docker
// load`). Same inputs, same bytes, same digest.
package imagebuild

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Options describe the image.
type Options struct {
	// Layers are directory trees, bottom first; each becomes one layer
	// with its contents at the image's root.
	Layers []Layer
	// Tag names the image in the archive (e.g. ghcr.io/ambientd/ambientd:dev).
	Tag        string
	Entrypoint []string
	Cmd        []string
	Env        []string
	Labels     map[string]string
	// Epoch is every file's mtime and the image's creation time
	// (SOURCE_DATE_EPOCH).
	Epoch time.Time
}

// Layer is one directory tree and what it holds (the history comment).
type Layer struct {
	Dir     string
	Comment string
}

// Build makes the image.
func Build(o Options) (v1.Image, error) {
	if o.Tag == "" {
		return nil, fmt.Errorf("image tag is required")
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	for _, l := range o.Layers {
		data, err := TarDir(l.Dir, o.Epoch)
		if err != nil {
			return nil, err
		}
		layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(data)), nil
		}, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", l.Dir, err)
		}
		img, err = mutate.Append(img, mutate.Addendum{Layer: layer, History: v1.History{
			Created: v1.Time{Time: o.Epoch}, CreatedBy: "imagebuild", Comment: l.Comment,
		}})
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", l.Dir, err)
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Created = v1.Time{Time: o.Epoch}
	cf.Config.Entrypoint = o.Entrypoint
	cf.Config.Cmd = o.Cmd
	cf.Config.Env = o.Env
	cf.Config.Labels = o.Labels
	cf.Config.User = "0:0"
	cf.Config.WorkingDir = "/"
	return mutate.ConfigFile(img, cf)
}

// TarDir renders dir as a layer tar: entries in lexical order, owned by
// root (uid/gid 0), mtimes set to epoch, hard links kept as links.
func TarDir(dir string, epoch time.Time) ([]byte, error) {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			paths = append(paths, p)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("walking %s: %w", dir, err)
	}
	sort.Strings(paths)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	seen := map[uint64]string{} // inode -> first name, for hard links
	for _, p := range paths {
		rel, _ := filepath.Rel(dir, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return nil, err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return nil, err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		hdr.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "root", "root"
		hdr.ModTime, hdr.AccessTime, hdr.ChangeTime = epoch, time.Time{}, time.Time{}
		hdr.Format = tar.FormatPAX
		hdr.PAXRecords = nil
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && fi.Mode().IsRegular() && st.Nlink > 1 {
			if first, ok := seen[st.Ino]; ok {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				seen[st.Ino] = hdr.Name
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		if hdr.Typeflag == tar.TypeReg {
			f, err := os.Open(p)
			if err != nil {
				return nil, err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return nil, fmt.Errorf("%s: %w", p, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// WriteArchive writes img as one tar holding an OCI image layout
// (oci-layout, index.json naming the image for containerd) plus docker's
// manifest.json over the same blobs. It returns the manifest digest.
func WriteArchive(w io.Writer, img v1.Image, tag string, epoch time.Time) (v1.Hash, error) {
	digest, err := img.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	rawManifest, err := img.RawManifest()
	if err != nil {
		return v1.Hash{}, err
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		return v1.Hash{}, err
	}
	rawConfig, err := img.RawConfigFile()
	if err != nil {
		return v1.Hash{}, err
	}
	layers, err := img.Layers()
	if err != nil {
		return v1.Hash{}, err
	}
	tw := tar.NewWriter(w)
	header := func(name string, typ byte, mode, size int64) error {
		return tw.WriteHeader(&tar.Header{Name: name, Typeflag: typ, Mode: mode, Size: size, ModTime: epoch, Uname: "root", Gname: "root", Format: tar.FormatPAX})
	}
	write := func(name string, data []byte) error {
		if err := header(name, tar.TypeReg, 0o644, int64(len(data))); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	blob := func(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := header(d, tar.TypeDir, 0o755, 0); err != nil {
			return v1.Hash{}, err
		}
	}
	if err := write(blob(cfgName), rawConfig); err != nil {
		return v1.Hash{}, err
	}
	var layerPaths []string
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			return v1.Hash{}, err
		}
		rc, err := l.Compressed()
		if err != nil {
			return v1.Hash{}, err
		}
		data, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			return v1.Hash{}, err
		}
		if err := write(blob(d), data); err != nil {
			return v1.Hash{}, err
		}
		layerPaths = append(layerPaths, blob(d))
	}
	if err := write(blob(digest), rawManifest); err != nil {
		return v1.Hash{}, err
	}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     types.OCIImageIndex,
		"manifests": []map[string]any{{
			"mediaType": types.OCIManifestSchema1,
			"digest":    digest.String(),
			"size":      len(rawManifest),
			"annotations": map[string]string{
				"io.containerd.image.name":          tag,
				"org.opencontainers.image.ref.name": refName(tag),
			},
		}},
	})
	if err != nil {
		return v1.Hash{}, err
	}
	dockerManifest, err := json.Marshal([]map[string]any{{
		"Config":   blob(cfgName),
		"RepoTags": []string{tag},
		"Layers":   layerPaths,
	}})
	if err != nil {
		return v1.Hash{}, err
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{"index.json", index},
		{"manifest.json", dockerManifest},
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
	} {
		if err := write(f.name, f.data); err != nil {
			return v1.Hash{}, err
		}
	}
	return digest, tw.Close()
}

// refName is the tag part of a reference (what OCI's ref.name annotation
// holds), or the whole reference when it has no tag.
func refName(ref string) string {
	for i := len(ref) - 1; i >= 0; i-- {
		switch ref[i] {
		case ':':
			return ref[i+1:]
		case '/':
			return ref
		}
	}
	return ref
}
