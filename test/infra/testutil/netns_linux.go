package testutil

import (
	"os"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// NetNS is a throwaway network namespace made for one test.
type NetNS struct {
	NS    ns.NetNS // the namespace; Path names its bind mount
	File  *os.File // an open handle on it, as handed to code under test
	Inode uint64   // its inode, as code that received File reports it
}

// NetNSOptions adjusts NewNetNSWith; the zero value is what NewNetNS does.
type NetNSOptions struct {
	// LoDown leaves lo down, the way a container runtime hands a fresh
	// sandbox to the first CNI plugin.
	LoDown bool
	// IgnoreRemovalErr does not fail the test when the namespace cannot be
	// unmounted at cleanup (a descriptor still held by code under test pins
	// the mount).
	IgnoreRemovalErr bool
}

// NewNetNS creates a network namespace with lo up, for a test that runs as
// root (see RequireRoot). File and the namespace are closed and the namespace
// is removed at cleanup; a failure to remove it fails the test.
func NewNetNS(t testing.TB) *NetNS {
	t.Helper()
	return NewNetNSWith(t, NetNSOptions{})
}

// NewNetNSWith is NewNetNS adjusted by o.
func NewNetNSWith(t testing.TB, o NetNSOptions) *NetNS {
	t.Helper()
	RequireRoot(t)
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("creating netns: %v", err)
	}
	t.Cleanup(func() {
		n.Close()
		if err := testutils.UnmountNS(n); err != nil && !o.IgnoreRemovalErr {
			t.Errorf("removing netns %s: %v", n.Path(), err)
		}
	})
	if !o.LoDown {
		if err := LoUp(n); err != nil {
			t.Fatalf("lo up: %v", err)
		}
	}
	f, err := os.Open(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return &NetNS{NS: n, File: f, Inode: st.Ino}
}

// LoUp brings up the loopback interface of n.
func LoUp(n ns.NetNS) error {
	return n.Do(func(ns.NetNS) error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	})
}
