package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// fileAttrs is what a rewrite of a file must keep besides its text: owner,
// group, permission bits and extended attributes (an SELinux label in
// security.selinux, POSIX ACLs in system.posix_acl_*, anything in user.* or
// trusted.*) — and, to tell whether the file changed since it was read, its
// identity: device, inode, size and change time (ctime moves on any write,
// chmod, chown or xattr change).
type fileAttrs struct {
	uid, gid uint32
	mode     os.FileMode // permission bits plus setuid, setgid, sticky
	xattrs   map[string][]byte

	dev, ino uint64
	size     int64
	ctime    unix.Timespec
}

// keeps reports whether a rewrite with b's attributes keeps a's (identity
// aside).
func (a fileAttrs) keeps(b fileAttrs) bool {
	return a.uid == b.uid && a.gid == b.gid && a.mode == b.mode &&
		maps.EqualFunc(a.xattrs, b.xattrs, bytes.Equal)
}

// sameFile reports whether a and b are the same, unchanged file.
func (a fileAttrs) sameFile(b fileAttrs) bool {
	return a.dev == b.dev && a.ino == b.ino && a.size == b.size && a.ctime == b.ctime
}

// snapshot is a regular file's text and attributes as read through one open
// file description.
type snapshot struct {
	data  []byte
	attrs fileAttrs
}

// same reports whether s and o are the same file with the same text and
// nothing else changed (not even its mode: ctime).
func (s snapshot) same(o snapshot) bool {
	return s.attrs.sameFile(o.attrs) && bytes.Equal(s.data, o.data)
}

// sameText reports whether s and o are the same inode with the same text:
// same minus ctime, which a rename of the file changes.
func (s snapshot) sameText(o snapshot) bool {
	return s.attrs.dev == o.attrs.dev && s.attrs.ino == o.attrs.ino && bytes.Equal(s.data, o.data)
}

// errNotRegular: a path that must be a regular file is not (a directory, a
// device, a FIFO, or a symlink where none may be).
var errNotRegular = errors.New("not a regular file")

// readSnapshot opens path without following a final symlink and reads it.
func readSnapshot(path string) (snapshot, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return snapshot{}, fmt.Errorf("%s: %w (a symlink)", path, errNotRegular)
		}
		return snapshot{}, err
	}
	defer f.Close()
	return readOpen(f)
}

// readOpen reads an open regular file from its start.
func readOpen(f *os.File) (snapshot, error) {
	attrs, err := statAttrs(f)
	if err != nil {
		return snapshot{}, err
	}
	data, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<62))
	if err != nil {
		return snapshot{}, fmt.Errorf("reading %s: %w", f.Name(), err)
	}
	return snapshot{data: data, attrs: attrs}, nil
}

func statAttrs(f *os.File) (fileAttrs, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fileAttrs{}, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fileAttrs{}, fmt.Errorf("%s: %w", f.Name(), errNotRegular)
	}
	a := fileAttrs{
		uid: st.Uid, gid: st.Gid,
		mode: os.FileMode(st.Mode & 0o777),
		dev:  st.Dev, ino: st.Ino, size: st.Size, ctime: st.Ctim,
	}
	if st.Mode&unix.S_ISUID != 0 {
		a.mode |= os.ModeSetuid
	}
	if st.Mode&unix.S_ISGID != 0 {
		a.mode |= os.ModeSetgid
	}
	if st.Mode&unix.S_ISVTX != 0 {
		a.mode |= os.ModeSticky
	}
	var err error
	if a.xattrs, err = readXattrs(int(f.Fd())); err != nil {
		return fileAttrs{}, fmt.Errorf("extended attributes of %s: %w", f.Name(), err)
	}
	return a, nil
}

// readXattrs returns every extended attribute of fd the process can read
// (nil when the filesystem has none or does not support them).
func readXattrs(fd int) (map[string][]byte, error) {
	size, err := unix.Flistxattr(fd, nil)
	if errors.Is(err, unix.ENOTSUP) || size == 0 {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	buf := make([]byte, size)
	if size, err = unix.Flistxattr(fd, buf); err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:size]), "\x00"), "\x00") {
		if name == "" {
			continue
		}
		n, err := unix.Fgetxattr(fd, name, nil)
		if errors.Is(err, unix.ENODATA) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		v := make([]byte, n)
		if n, err = unix.Fgetxattr(fd, name, v); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		out[name] = v[:n]
	}
	return out, nil
}

// applyAttrs gives the open file f (a new temp file of ours) a's mode,
// extended attributes, owner and group — in that order, so that only the
// last step needs CAP_CHOWN, and only when a's owner is not us. An
// attribute the new file already has with the same value (e.g. an SELinux
// label the directory gave it) is not set again; one that cannot be set is
// an error: a config that lost its label may be unreadable to the runtime.
// (chown clears setuid and setgid, which no CNI config has.)
func applyAttrs(f *os.File, a fileAttrs) error {
	fd := int(f.Fd())
	if err := f.Chmod(a.mode); err != nil {
		return fmt.Errorf("chmod %s: %w", f.Name(), err)
	}
	have, err := readXattrs(fd)
	if err != nil {
		return fmt.Errorf("extended attributes of %s: %w", f.Name(), err)
	}
	for name, v := range a.xattrs {
		if old, ok := have[name]; ok && bytes.Equal(old, v) {
			continue
		}
		if err := unix.Fsetxattr(fd, name, v, 0); err != nil {
			return fmt.Errorf("setting extended attribute %s on %s: %w", name, f.Name(), err)
		}
	}
	if err := f.Chown(int(a.uid), int(a.gid)); err != nil {
		return fmt.Errorf("chown %s to %d:%d: %w", f.Name(), a.uid, a.gid, err)
	}
	return nil
}

// newFileAttrs are the attributes of a file the installer creates with no
// original to copy: root's, mode 0600 (Istio's since 1.30: the config
// names the agent's socket).
func newFileAttrs() fileAttrs {
	return fileAttrs{uid: uint32(os.Geteuid()), gid: uint32(os.Getegid()), mode: 0o600}
}
