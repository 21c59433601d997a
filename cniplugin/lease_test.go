package cniplugin

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/cniapi"
)

// What the plugin reads of the install lease (pure logic): which leases it
// trusts and understands, which say the agent decided to uninstall, and
// which are past their TTL (reported only: time alone never lets a pod
// through, see TestDecideAbsent).
func TestJudgeLease(t *testing.T) {
	now := time.Date(2026, 1, 2, 12, 0, 0, 0, time.UTC)
	bootedLongAgo := now.Add(-48 * time.Hour)
	lease := func(mut func(*cniapi.InstallLease)) []byte {
		l := cniapi.InstallLease{Version: cniapi.LeaseVersion, State: cniapi.LeaseInstalled, Renewed: now.Add(-time.Minute),
			TTL: "10m", ConfDir: "/etc/cni/net.d", OwnedName: "00-ambientd.conflist"}
		if mut != nil {
			mut(&l)
		}
		b, err := json.Marshal(l)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	tests := []struct {
		name    string
		data    []byte
		readErr error
		boot    time.Time
		want    string // closed (not usable), installed, away-long, uninstalling
		reason  string // a substring of the verdict's reason
	}{
		{"fresh lease: agent restarting, crashing or upgrading", lease(nil), nil, bootedLongAgo, "installed", "installed; no agent renewed"},
		{"expired lease: no agent for the TTL", lease(func(l *cniapi.InstallLease) { l.Renewed = now.Add(-11 * time.Minute) }), nil, bootedLongAgo, "away-long", "for 11m0s since its last renewal"},
		{"just within the TTL", lease(func(l *cniapi.InstallLease) { l.Renewed = now.Add(-10 * time.Minute) }), nil, bootedLongAgo, "installed", "installed; no agent renewed"},
		{"uninstall decided", lease(func(l *cniapi.InstallLease) { l.State = cniapi.LeaseUninstalling }), nil, bootedLongAgo, "uninstalling", "decided to uninstall"},
		{"uninstall decided, renewed just now", lease(func(l *cniapi.InstallLease) { l.State = cniapi.LeaseUninstalling; l.Renewed = now }), nil, bootedLongAgo, "uninstalling", "decided to uninstall"},
		{"node off for a day, booted 1m ago: the TTL counts from boot", lease(func(l *cniapi.InstallLease) { l.Renewed = now.Add(-24 * time.Hour) }), nil, now.Add(-time.Minute), "installed", "since the node's boot"},
		{"node booted longer than the TTL ago, no agent since", lease(func(l *cniapi.InstallLease) { l.Renewed = now.Add(-24 * time.Hour) }), nil, now.Add(-11 * time.Minute), "away-long", "since the node's boot"},
		{"renewal in the future (clock stepped back)", lease(func(l *cniapi.InstallLease) { l.Renewed = now.Add(time.Hour) }), nil, bootedLongAgo, "installed", "installed; no agent renewed"},
		{"no lease", nil, fs.ErrNotExist, bootedLongAgo, "closed", "no install lease"},
		{"unreadable lease", nil, errors.New("/opt/cni/bin/ambientd-cni.lease is owned by uid 1000, not 0"), bootedLongAgo, "closed", "owned by uid 1000"},
		{"garbage", []byte("\x00\xffnot json"), nil, bootedLongAgo, "closed", "not valid JSON"},
		{"empty file", []byte{}, nil, bootedLongAgo, "closed", "not valid JSON"},
		{"two objects", append(lease(func(l *cniapi.InstallLease) { l.State = cniapi.LeaseUninstalling }), lease(nil)...), nil, bootedLongAgo, "closed", "data after its JSON object"},
		{"JSON array", []byte(`[1,2]`), nil, bootedLongAgo, "closed", "not valid JSON"},
		{"unknown version", lease(func(l *cniapi.InstallLease) { l.Version = 2; l.State = cniapi.LeaseUninstalling }), nil, bootedLongAgo, "closed", "version 2"},
		{"no version", []byte(`{"state":"uninstalling","renewed":"2026-01-02T11:00:00Z","ttl":"10m","confDir":"/etc/cni/net.d"}`), nil, bootedLongAgo, "closed", "version 0"},
		{"unknown state", lease(func(l *cniapi.InstallLease) { l.State = "gone"; l.Renewed = now.Add(-time.Hour) }), nil, bootedLongAgo, "closed", `state "gone"`},
		{"bad ttl", lease(func(l *cniapi.InstallLease) { l.TTL = "soon"; l.Renewed = now.Add(-time.Hour) }), nil, bootedLongAgo, "closed", `ttl "soon"`},
		{"zero ttl", lease(func(l *cniapi.InstallLease) { l.TTL = "0s"; l.Renewed = now.Add(-time.Hour) }), nil, bootedLongAgo, "closed", `ttl "0s"`},
		{"negative ttl", lease(func(l *cniapi.InstallLease) { l.TTL = "-1m" }), nil, bootedLongAgo, "closed", `ttl "-1m"`},
		{"ttl past a week", lease(func(l *cniapi.InstallLease) { l.TTL = "1000h" }), nil, bootedLongAgo, "closed", `ttl "1000h"`},
		{"relative conf dir", lease(func(l *cniapi.InstallLease) { l.ConfDir = "etc/cni"; l.State = cniapi.LeaseUninstalling }), nil, bootedLongAgo, "closed", "confDir"},
		{"no renewal time", lease(func(l *cniapi.InstallLease) { l.Renewed = time.Time{}; l.State = cniapi.LeaseUninstalling }), nil, bootedLongAgo, "closed", "no renewal time"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := judgeLease(tt.data, tt.readErr, now, tt.boot)
			got := "closed"
			switch {
			case v.uninstalling:
				got = "uninstalling"
			case v.usable && v.awayLong:
				got = "away-long"
			case v.usable:
				got = "installed"
			}
			if got != tt.want || !strings.Contains(v.reason, tt.reason) {
				t.Errorf("%s, reason %q; want %s, reason containing %q", got, v.reason, tt.want, tt.reason)
			}
			if !v.usable && !strings.Contains(v.reason, "waiting for the agent") {
				t.Errorf("a lease the plugin cannot use must say that the pod waits for the agent: %q", v.reason)
			}
		})
	}
}

// readLease refuses a lease anyone but the plugin's own user could have
// written.
func TestReadLeaseRefusesUntrustedFiles(t *testing.T) {
	dir := t.TempDir()
	ok := filepath.Join(dir, "ok.lease")
	if err := os.WriteFile(ok, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readLease(ok); err != nil {
		t.Errorf("own 0644 lease: %v", err)
	}
	writable := filepath.Join(dir, "w.lease")
	if err := os.WriteFile(writable, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(writable, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, err := readLease(writable); err == nil || !strings.Contains(err.Error(), "writable by group or others") {
		t.Errorf("world-writable lease: %v", err)
	}
	link := filepath.Join(dir, "l.lease")
	if err := os.Symlink(ok, link); err != nil {
		t.Fatal(err)
	}
	if _, err := readLease(link); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("symlinked lease: %v", err)
	}
	big := filepath.Join(dir, "big.lease")
	if err := os.WriteFile(big, make([]byte, maxLeaseSize+1), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readLease(big); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("oversized lease: %v", err)
	}
	if _, err := readLease(filepath.Join(dir, "missing.lease")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing lease: %v, want ErrNotExist", err)
	}
}

// lockDir gives up when another process holds the bin dir's lock past the
// deadline (any local user can hold a lock on a directory it can open), and
// takes it once it is free.
func TestLockDirHasADeadline(t *testing.T) {
	dir := t.TempDir()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(fd, unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if unlock, err := lockDir(ctx, dir); err == nil || !strings.Contains(err.Error(), "held by another process") {
		if err == nil {
			unlock()
		}
		t.Fatalf("lockDir with the lock held elsewhere: %v, want an error once the deadline passed", err)
	}
	unix.Close(fd)
	unlock, err := lockDir(context.Background(), dir)
	if err != nil {
		t.Fatalf("lockDir with the lock free: %v", err)
	}
	unlock()
}
