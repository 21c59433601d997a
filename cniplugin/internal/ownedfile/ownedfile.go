// Package ownedfile reads the files the agent leaves the plugin on the
// host (the install lease, the plugin's kubeconfig), refusing any that
// someone else could have written: a symlink, not a regular file, owned by
// another user than the plugin's (root, under a runtime), or open to group
// or others beyond what the caller allows.
package ownedfile

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// Read returns path's content. forbidden is the mode bits no one but the
// owner may have (0o022: nobody else writes; 0o077: nobody else reads or
// writes); max bounds the size.
func Read(path string, forbidden os.FileMode, max int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, fmt.Errorf("%s is a symlink", path)
		}
		return nil, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, fmt.Errorf("%s is not a regular file", path)
	case st.Uid != uint32(os.Geteuid()):
		return nil, fmt.Errorf("%s is owned by uid %d, not %d", path, st.Uid, os.Geteuid())
	case os.FileMode(st.Mode)&forbidden&0o022 != 0:
		return nil, fmt.Errorf("%s is writable by group or others (mode %#o)", path, st.Mode&0o777)
	case os.FileMode(st.Mode)&forbidden != 0:
		return nil, fmt.Errorf("%s is open to group or others (mode %#o)", path, st.Mode&0o777)
	}
	data, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	if int64(len(data)) > max {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, max)
	}
	return data, nil
}
