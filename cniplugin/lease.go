package cniplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniplugin/internal/ownedfile"
)

// When no agent listens on the socket, the install lease beside the plugin
// binary (cniapi.InstallLease) says what the agent would decide: the plugin
// reads the pod and its namespace from the API and applies the agent's own
// policy (absent.go). Only proof lets it remove itself and let a mesh pod
// through: the lease says the agent decided to uninstall, or the API says
// the agent's DaemonSet is gone. No lease, a lease it cannot read or does
// not trust, and time alone, fail closed. docs/install.md, "While no agent
// answers"; docs/security.md says who can trigger what.

// maxLeaseSize bounds what the plugin reads of a lease file.
const maxLeaseSize = 64 << 10

// leaseVerdict is what a lease says about an agent that is not there.
type leaseVerdict struct {
	lease cniapi.InstallLease
	// usable: the lease was read, trusted and understood.
	usable bool
	// uninstalling: the agent decided to uninstall; finish it.
	uninstalling bool
	// awayLong: no agent renewed the lease for its TTL (counted from the
	// later of the renewal and the boot). Reported, never acted on.
	awayLong bool
	reason   string
}

// judgeLease reads the lease (pure): data is the lease file's text
// (readErr when it could not be read), now the time and boot the node's
// boot time.
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
	if err != nil || ttl < cniapi.MinLeaseTTL || ttl > cniapi.MaxLeaseTTL {
		return bad(fmt.Sprintf("has ttl %q, not a Go duration from %v to %v", l.TTL, cniapi.MinLeaseTTL, cniapi.MaxLeaseTTL))
	}
	if !filepath.IsAbs(l.ConfDir) {
		return bad(fmt.Sprintf("has confDir %q, not an absolute path", l.ConfDir))
	}
	if l.Renewed.IsZero() {
		return bad("has no renewal time")
	}
	switch l.State {
	case cniapi.LeaseUninstalling:
		return leaseVerdict{lease: l, usable: true, uninstalling: true, reason: fmt.Sprintf("the agent decided to uninstall (lease uninstalling since %s) and is gone", l.Renewed.UTC().Format(time.RFC3339))}
	case cniapi.LeaseInstalled:
	default:
		return bad(fmt.Sprintf("has state %q, not %q or %q", l.State, cniapi.LeaseInstalled, cniapi.LeaseUninstalling))
	}
	since, from := l.Renewed, "its last renewal"
	if boot.After(since) {
		since, from = boot, "the node's boot"
	}
	age := now.Sub(since)
	return leaseVerdict{lease: l, usable: true, awayLong: age > ttl,
		reason: fmt.Sprintf("installed; no agent renewed the lease for %v since %s (%s; ttl %v)", age.Round(time.Second), from, since.UTC().Format(time.RFC3339), ttl)}
}

// readLease reads the lease at path, refusing one that is not a regular
// file owned by this process's user (root, under a runtime) and writable
// by nobody else: only the agent that installed the plugin writes it.
func readLease(path string) ([]byte, error) { return ownedfile.Read(path, 0o022, maxLeaseSize) }

// bootTime is when the node booted, from its uptime.
func bootTime(now time.Time) (time.Time, error) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return time.Time{}, fmt.Errorf("sysinfo: %w", err)
	}
	return now.Add(-time.Duration(si.Uptime) * time.Second), nil
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

// lockDir takes an exclusive flock on dir until the returned func runs,
// waiting for it until ctx ends: any local user can hold a lock on a
// directory it can open, and an ADD must not wait for ever.
func lockDir(ctx context.Context, dir string) (func(), error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Close(fd) }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			unix.Close(fd)
			return nil, fmt.Errorf("flock %s: %w", dir, err)
		}
		select {
		case <-ctx.Done():
			unix.Close(fd)
			return nil, fmt.Errorf("flock %s: held by another process: %w", dir, ctx.Err())
		case <-time.After(wait):
		}
	}
}
