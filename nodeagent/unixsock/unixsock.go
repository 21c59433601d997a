// Package unixsock is the socket plumbing both agent servers (CNI events and
// ztunnel) share: create the socket directory, replace a stale socket left by
// a previous agent (never anything else), listen with a mode, remove the
// socket at shutdown only if it is still ours, and read a peer's credentials.
package unixsock

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// FileID identifies one file across a remove and re-create at the same path.
// The change time is part of it because tmpfs (/var/run) hands a freed inode
// number straight to the next file.
type FileID struct {
	dev, ino uint64
	ctime    syscall.Timespec
}

// IDOf returns the identity of the file fi describes.
func IDOf(fi os.FileInfo) FileID {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return FileID{dev: uint64(st.Dev), ino: st.Ino, ctime: st.Ctim}
	}
	return FileID{}
}

// Socket is a socket file Listen created.
type Socket struct {
	Path string
	id   FileID
}

// Listen listens on a Unix socket at path: network is "unix" (stream) or
// "unixpacket" (SEQPACKET). It creates the directory and replaces a socket
// file left by a previous agent: only one agent runs per node and this is
// it, so nothing listening there should be deferred to. Anything else at path
// is an error: never delete a user's file. A non-zero mode is applied after
// bind (which honours the umask); a peer that connects in between is still
// subject to the server's peer check. Closing the listener does not unlink
// the file: call RemoveIfOurs.
func Listen(path, network string, mode os.FileMode) (*net.UnixListener, *Socket, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, nil, fmt.Errorf("create socket directory for %s: %w", path, err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, nil, fmt.Errorf("refusing to replace %s: it is a %v, not a socket", path, fi.Mode().Type())
		}
		if err := os.Remove(path); err != nil {
			return nil, nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("inspect socket path %s: %w", path, err)
	}
	ln, err := net.ListenUnix(network, &net.UnixAddr{Name: path, Net: network})
	if err != nil {
		return nil, nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	fail := func(what string, err error) (*net.UnixListener, *Socket, error) {
		ln.Close()
		os.Remove(path)
		return nil, nil, fmt.Errorf("%s socket %s: %w", what, path, err)
	}
	if mode != 0 {
		if err := os.Chmod(path, mode); err != nil {
			return fail("chmod", err)
		}
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return fail("stat", err)
	}
	return ln, &Socket{Path: path, id: IDOf(fi)}, nil
}

// RemoveIfOurs removes the socket file only if it is still the one Listen
// created: an overlapping agent may already have replaced it.
func (s *Socket) RemoveIfOurs(log *slog.Logger) {
	fi, err := os.Lstat(s.Path)
	if err != nil {
		return
	}
	if IDOf(fi) != s.id {
		log.Info("socket path now belongs to another server; leaving it", "socket", s.Path)
		return
	}
	if err := os.Remove(s.Path); err != nil {
		log.Warn("remove socket", "socket", s.Path, "error", err)
	}
}

// PeerCred returns the credentials the kernel recorded for the process on the
// other end of c at connect(2) (SO_PEERCRED).
func PeerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, fmt.Errorf("peer credentials: %w", err)
	}
	if credErr != nil {
		return nil, fmt.Errorf("peer credentials: getsockopt SO_PEERCRED: %w", credErr)
	}
	return cred, nil
}
