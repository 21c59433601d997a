package cniinstall

import (
	"crypto/sha256"
	"fmt"
	"io"
	"os"
)

// ensureBinary copies BinSource into BinDir unless an identical copy is
// there: temp file + rename, so a runtime exec'ing it never sees half a file.
func (i *Installer) ensureBinary() (bool, error) {
	dst := i.binPath()
	if i.bin.srcSize == 0 {
		sum, size, err := hashFile(i.cfg.BinSource)
		if err != nil {
			return false, fmt.Errorf("reading plugin binary: %w", err)
		}
		i.bin.srcSum, i.bin.srcSize = sum, size
	}
	if have, err := statPath(dst); err == nil && have.mode&0o111 != 0 {
		if have.sameFile(i.bin.verified) {
			return false, nil
		}
		if sum, size, err := hashFile(dst); err == nil && size == i.bin.srcSize && sum == i.bin.srcSum {
			i.bin.verified = have
			return false, nil
		}
	}
	want, err := os.ReadFile(i.cfg.BinSource)
	if err != nil {
		return false, fmt.Errorf("reading plugin binary: %w", err)
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return false, fmt.Errorf("creating CNI bin dir: %w", err)
	}
	attrs := newFileAttrs()
	attrs.mode = 0o755
	if err := writeAtomic(dst, want, attrs); err != nil {
		return false, fmt.Errorf("installing plugin binary: %w", err)
	}
	i.bin.srcSum, i.bin.srcSize = sha256.Sum256(want), int64(len(want))
	if have, err := statPath(dst); err == nil {
		i.bin.verified = have
	}
	i.log.Info("installed CNI plugin binary", "path", dst, "bytes", len(want))
	return true, nil
}

func hashFile(path string) ([sha256.Size]byte, int64, error) {
	var sum [sha256.Size]byte
	f, err := os.Open(path)
	if err != nil {
		return sum, 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return sum, 0, err
	}
	copy(sum[:], h.Sum(nil))
	return sum, n, nil
}

// statPath is the identity and mode of path (following symlinks).
func statPath(path string) (fileAttrs, error) {
	f, err := os.Open(path)
	if err != nil {
		return fileAttrs{}, err
	}
	defer f.Close()
	return statAttrs(f)
}
