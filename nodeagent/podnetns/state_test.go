package podnetns

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/ambientd/ambientd/iptables"
)

// A recorded namespace is found again by a fresh State (a restarted agent)
// while its path holds the same namespace; a corrupt file is an error with
// an empty, usable State.
func TestStateRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "pods.json")
	s, err := OpenState(path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := s.Put("uid-a", h, iptables.PodOptions{DNSCapture: true}); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("state file %v, %v: want mode 0600", fi, err)
	}
	again, err := OpenState(path)
	if err != nil {
		t.Fatal(err)
	}
	got, ok := again.Open("uid-a")
	if !ok || got.Inode() != h.Inode() {
		t.Fatalf("Open(uid-a) = %v, %v; want inode %d", got, ok, h.Inode())
	}
	got.Close()
	if o, ok := again.Options("uid-a"); !ok || !o.DNSCapture {
		t.Errorf("recorded options %+v, %v; want DNS capture on", o, ok)
	}
	if _, ok := again.Open("uid-b"); ok {
		t.Error("unknown uid found")
	}
	// Same path, another namespace (inode differs): not ours.
	again.m["uid-c"] = Record{Path: "/proc/self/ns/net", Inode: h.Inode() + 1}
	if _, ok := again.Open("uid-c"); ok {
		t.Error("a path now holding another namespace was accepted")
	}
	if err := again.Delete("uid-a"); err != nil {
		t.Fatal(err)
	}
	third, _ := OpenState(path)
	if _, ok := third.Open("uid-a"); ok {
		t.Error("deleted uid still recorded")
	}

	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad, err := OpenState(path)
	if err == nil {
		t.Error("corrupt state file: no error")
	}
	if err := bad.Put("uid-a", h, iptables.PodOptions{}); err != nil {
		t.Fatalf("Put after a corrupt file: %v", err)
	}
}

// Retain drops the records of pods that are gone, in the file too.
func TestStateRetain(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pods.json")
	s, _ := OpenState(path)
	h, err := Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, uid := range []string{"live", "gone-1", "gone-2"} {
		if err := s.Put(uid, h, iptables.PodOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	dropped, err := s.Retain(func(uid string) bool { return uid == "live" })
	if err != nil || len(dropped) != 2 || dropped[0] != "gone-1" {
		t.Fatalf("Retain = %v, %v", dropped, err)
	}
	again, _ := OpenState(path)
	if !again.Has("live") || again.Has("gone-1") || again.Has("gone-2") {
		t.Errorf("after Retain the file holds live=%v gone-1=%v gone-2=%v", again.Has("live"), again.Has("gone-1"), again.Has("gone-2"))
	}
	if dropped, err := again.Retain(func(string) bool { return true }); err != nil || dropped != nil {
		t.Errorf("Retain of nothing: %v %v", dropped, err)
	}
}
