// Package bundle writes `ambientd bundle`: one tar.gz for a support ticket
// with what the agent on this node knows and shows — its settings, the
// status of every pod (admin socket), the CNI conf dir and install lease,
// the rules, the agent's errors, the node's Events and the agent's
// metrics. Every file is capped, the whole archive is capped, and every
// file passes through Redact: no credential leaves the node in it (the
// plugin's kubeconfig and other kubeconfigs are never read at all).
package bundle

import (
	"archive/tar"
	"compress/gzip"
	"fmt"
	"io"
	"path"
	"strings"
	"time"
)

// Limits bound the archive (uncompressed sizes).
type Limits struct {
	// MaxFileBytes caps each file; a longer one is cut and says so.
	MaxFileBytes int64
	// MaxTotalBytes caps the sum of the files; once reached, further files
	// are left out and MANIFEST.txt names them.
	MaxTotalBytes int64
}

// DefaultLimits keep a bundle small enough to attach to a ticket.
var DefaultLimits = Limits{MaxFileBytes: 4 << 20, MaxTotalBytes: 32 << 20}

// ManifestName is the archive's table of contents, written last: every
// file with its size and whether it was cut, every file left out, and
// every section that could not be collected, with the reason.
const ManifestName = "MANIFEST.txt"

// Archive writes a capped, redacted tar.gz under one top directory.
type Archive struct {
	gz       *gzip.Writer
	tw       *tar.Writer
	dir      string
	limits   Limits
	now      time.Time
	total    int64
	manifest []string
	err      error
}

// NewArchive starts an archive on w whose files live under dir/.
func NewArchive(w io.Writer, dir string, limits Limits, now time.Time) *Archive {
	gz := gzip.NewWriter(w)
	return &Archive{gz: gz, tw: tar.NewWriter(gz), dir: dir, limits: limits, now: now}
}

// Add writes one file, redacted, cut at the per-file cap, left out when
// the total cap is reached. Errors are kept for Close.
func (a *Archive) Add(name string, data []byte) { a.AddSized(name, data, 0) }

// AddSized is Add for data read from a source of size bytes, of which
// data may be only the beginning: the manifest and the cut file say the
// source's size.
func (a *Archive) AddSized(name string, data []byte, size int64) {
	if a.err != nil {
		return
	}
	partial := size > int64(len(data)) // the source was not read whole
	data = Redact(data)
	if !partial {
		size = int64(len(data))
	}
	if a.total >= a.limits.MaxTotalBytes {
		a.manifest = append(a.manifest, fmt.Sprintf("left out  %s (%d bytes): the bundle reached --max-total-bytes=%d", name, size, a.limits.MaxTotalBytes))
		return
	}
	keep := min(int64(len(data)), a.limits.MaxFileBytes, a.limits.MaxTotalBytes-a.total)
	line := fmt.Sprintf("file      %s (%d bytes)", name, size)
	if keep < int64(len(data)) || partial {
		why := fmt.Sprintf("--max-file-bytes=%d", a.limits.MaxFileBytes)
		if keep < a.limits.MaxFileBytes {
			why = fmt.Sprintf("--max-total-bytes=%d", a.limits.MaxTotalBytes)
		}
		marker := fmt.Sprintf("\n[ambientd bundle: truncated: %d of %d bytes kept (%s)]\n", keep, size, why)
		data = append(data[:keep:keep], marker...)
		line = fmt.Sprintf("truncated %s (%d of %d bytes kept: %s)", name, keep, size, why)
	}
	a.total += keep
	a.manifest = append(a.manifest, line)
	a.write(name, data)
}

// Note records in the manifest a section that could not be collected.
func (a *Archive) Note(format string, args ...any) {
	a.manifest = append(a.manifest, "note      "+fmt.Sprintf(format, args...))
}

func (a *Archive) write(name string, data []byte) {
	if a.err != nil {
		return
	}
	hdr := &tar.Header{Name: path.Join(a.dir, name), Mode: 0o644, Size: int64(len(data)), ModTime: a.now, Typeflag: tar.TypeReg}
	if a.err = a.tw.WriteHeader(hdr); a.err == nil {
		_, a.err = a.tw.Write(data)
	}
}

// Close writes the manifest and finishes the archive.
func (a *Archive) Close() error {
	var b strings.Builder
	fmt.Fprintf(&b, "ambientd bundle, %s\nlimits: --max-file-bytes=%d --max-total-bytes=%d; %d bytes of files\n\n",
		a.now.UTC().Format(time.RFC3339), a.limits.MaxFileBytes, a.limits.MaxTotalBytes, a.total)
	for _, l := range a.manifest {
		b.WriteString(l + "\n")
	}
	a.write(ManifestName, Redact([]byte(b.String())))
	if a.err != nil {
		return a.err
	}
	if err := a.tw.Close(); err != nil {
		return err
	}
	return a.gz.Close()
}
