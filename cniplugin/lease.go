package cniplugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
)

// When no agent listens on the socket, the install lease beside the plugin
// binary (cniapi.InstallLease) tells an agent that is coming back (fail
// closed, as always) from one that is gone for good: the agent decided to
// uninstall, or no agent process started on this node for the lease's TTL.
// Only then does the plugin finish the uninstall itself and let the pod
// through. Everything else — no lease, a lease it cannot read or does not
// trust, a fresh one — fails closed. docs/install.md, "An uninstall nobody
// finished"; docs/security.md says who can trigger it.

// maxLeaseSize bounds what the plugin reads of a lease file.
const maxLeaseSize = 64 << 10

// leaseVerdict is what a lease says about an agent that is not there.
type leaseVerdict struct {
	lease cniapi.InstallLease
	// gone: the agent is not coming back; finish the uninstall.
	gone   bool
	reason string
}

// judgeLease is the decision table (pure): data is the lease file's text
// (readErr when it could not be read), now the time and boot the node's
// boot time. The TTL runs from max(renewal, boot): a node powered off for
// longer than the TTL must not find its lease expired at boot, before its
// agent had a chance to start.
func judgeLease(data []byte, readErr error, now, boot time.Time) leaseVerdict {
	if errors.Is(readErr, fs.ErrNotExist) {
		return leaseVerdict{reason: "no install lease: the agent that installed the plugin predates leases or the lease was removed; waiting for the agent"}
	}
	if readErr != nil {
		return leaseVerdict{reason: fmt.Sprintf("install lease unusable (%v); waiting for the agent", readErr)}
	}
	var l cniapi.InstallLease
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&l); err != nil {
		return leaseVerdict{reason: fmt.Sprintf("install lease is not valid JSON (%v); waiting for the agent", err)}
	}
	if dec.More() {
		return leaseVerdict{reason: "install lease has data after its JSON object; waiting for the agent"}
	}
	bad := func(why string) leaseVerdict {
		return leaseVerdict{lease: l, reason: "install lease " + why + "; waiting for the agent"}
	}
	if l.Version != cniapi.LeaseVersion {
		return bad(fmt.Sprintf("has version %d, this plugin reads %d", l.Version, cniapi.LeaseVersion))
	}
	ttl, err := time.ParseDuration(l.TTL)
	if err != nil || ttl <= 0 {
		return bad(fmt.Sprintf("has ttl %q, not a positive Go duration", l.TTL))
	}
	if !filepath.IsAbs(l.ConfDir) {
		return bad(fmt.Sprintf("has confDir %q, not an absolute path", l.ConfDir))
	}
	if l.Renewed.IsZero() {
		return bad("has no renewal time")
	}
	switch l.State {
	case cniapi.LeaseUninstalling:
		return leaseVerdict{lease: l, gone: true, reason: fmt.Sprintf("the agent decided to uninstall (lease uninstalling since %s) and is gone", l.Renewed.UTC().Format(time.RFC3339))}
	case cniapi.LeaseInstalled:
	default:
		return bad(fmt.Sprintf("has state %q, not %q or %q", l.State, cniapi.LeaseInstalled, cniapi.LeaseUninstalling))
	}
	since, from := l.Renewed, "its last renewal"
	if boot.After(since) {
		since, from = boot, "the node's boot"
	}
	if age := now.Sub(since); age > ttl {
		return leaseVerdict{lease: l, gone: true, reason: fmt.Sprintf("no agent started on this node for %v since %s (%s; lease ttl %v): taking it for uninstalled", age.Round(time.Second), from, since.UTC().Format(time.RFC3339), ttl)}
	}
	return leaseVerdict{lease: l, reason: fmt.Sprintf("install lease is fresh (renewed %s, ttl %v, counted from %s): the agent is expected back; waiting for it", l.Renewed.UTC().Format(time.RFC3339), ttl, from)}
}

// readLease reads the lease at path, refusing one that is not a regular
// file owned by this process's user (root, under a runtime) and writable
// by nobody else: only the agent that installed the plugin writes it.
func readLease(path string) ([]byte, error) {
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
	case st.Mode&0o022 != 0:
		return nil, fmt.Errorf("%s is writable by group or others (mode %#o)", path, st.Mode&0o777)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxLeaseSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(data) > maxLeaseSize {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxLeaseSize)
	}
	return data, nil
}

// bootTime is when the node booted, from its uptime.
func bootTime(now time.Time) (time.Time, error) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return time.Time{}, fmt.Errorf("sysinfo: %w", err)
	}
	return now.Add(-time.Duration(si.Uptime) * time.Second), nil
}

// agentGone is called when no agent listens on the socket. It reads the
// lease beside the plugin binary and, when the lease says the agent is gone
// for good, finishes the uninstall (our config entries, then the binary,
// then the lease) and returns true: the pod goes through. The work runs
// under a lock on the bin dir, so that the many ADDs of a node coming back
// do it once.
func agentGone(log *slog.Logger) bool {
	exe, err := os.Executable()
	if err != nil {
		log.Error("cannot locate the plugin binary to read its install lease; waiting for the agent", "error", err)
		return false
	}
	leasePath := exe + cniapi.LeaseSuffix
	v := judgeNow(leasePath)
	if !v.gone {
		log.Warn("no agent on the socket; waiting for it", "reason", v.reason, "path", leasePath)
		return false
	}
	unlock, err := lockDir(filepath.Dir(exe))
	if err != nil {
		log.Error("cannot lock the CNI bin dir to finish the uninstall; waiting for the agent", "error", err)
		return false
	}
	defer unlock()
	// Again under the lock: another ADD may have finished it meanwhile.
	if v = judgeNow(leasePath); !v.gone {
		if _, err := os.Stat(leasePath); errors.Is(err, fs.ErrNotExist) {
			log.Info("another ADD finished the uninstall the agent left; passing the pod through", "path", leasePath)
			return true
		}
		log.Warn("no agent on the socket; waiting for it", "reason", v.reason, "path", leasePath)
		return false
	}
	log = log.With("path", leasePath, "cni_conf_dir", v.lease.ConfDir)
	log.Warn("no agent on the socket and the install lease says it is gone; finishing the uninstall and passing the pod through", "reason", v.reason)
	inst, err := cniinstall.FromLease(v.lease, exe, log.With("component", "cni-uninstall"))
	if err == nil {
		err = inst.FinishUninstall()
	}
	if err != nil {
		// The agent is gone for good either way: let the pod start, and
		// let the next ADD try the cleanup again.
		log.Error("could not finish the uninstall; passing the pod through, the next ADD tries again", "error", err)
		return true
	}
	log.Warn("finished the uninstall the agent left: our CNI config entries, the plugin binary and the install lease are removed (host probe rules stay until the next install or `ambientd uninstall`)")
	return true
}

func judgeNow(leasePath string) leaseVerdict {
	data, err := readLease(leasePath)
	now := time.Now()
	boot, berr := bootTime(now)
	if err == nil && berr != nil {
		err = berr
	}
	return judgeLease(data, err, now, boot)
}

// lockDir takes an exclusive flock on dir until the returned func runs.
func lockDir(dir string) (func(), error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	if err := unix.Flock(fd, unix.LOCK_EX); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("flock %s: %w", dir, err)
	}
	return func() { unix.Close(fd) }, nil
}
