package podnetns

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
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

// The file is a journal: a change appends one line (N pods' ADDs write
// O(N) bytes, not O(N²)), a fresh State reads the last word on every uid,
// the journal is compacted once superseded lines pile up, an append cut
// short is dropped, and an older agent's file (one JSON object) is read
// and turned into a journal at the first change.
func TestStateJournal(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pods.json")
	h, err := Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	s, _ := OpenState(path)
	t.Cleanup(func() { s.Close() })
	size := func() int64 {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	if err := s.Put("uid-0", h, iptables.PodOptions{}); err != nil {
		t.Fatal(err)
	}
	one := size()
	for i := 1; i < 100; i++ {
		if err := s.Put(fmt.Sprintf("uid-%d", i), h, iptables.PodOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if got := size(); got > 101*one {
		t.Errorf("100 records take %d bytes, one took %d: not one line per record", got, one)
	}
	before := size()
	if err := s.Put("uid-100", h, iptables.PodOptions{}); err != nil {
		t.Fatal(err)
	}
	if grew := size() - before; grew > 2*one {
		t.Errorf("one more record grew the file by %d bytes (one record is %d): the file was rewritten", grew, one)
	}
	// Deleting and re-adding piles up superseded lines: the journal stays
	// within twice the live records plus the margin.
	for round := range 5 {
		for i := range 50 {
			uid := fmt.Sprintf("uid-%d", i)
			if err := s.Delete(uid); err != nil {
				t.Fatal(err)
			}
			if err := s.Put(uid, h, iptables.PodOptions{DNSCapture: round%2 == 0}); err != nil {
				t.Fatal(err)
			}
		}
	}
	b, _ := os.ReadFile(path)
	if n := strings.Count(string(b), "\n"); n > 2*101+compactMargin {
		t.Errorf("journal of 101 live records has %d lines: never compacted", n)
	}
	again, err := OpenState(path)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	for i := range 101 {
		if !again.Has(fmt.Sprintf("uid-%d", i)) {
			t.Fatalf("uid-%d lost", i)
		}
	}
	if o, _ := again.Options("uid-3"); o.DNSCapture != true { // round 4 wrote DNSCapture on
		t.Errorf("uid-3's options %+v: not the last change", o)
	}

	// An append cut short: the records before it stand.
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"uid":"uid-x","rec`)
	f.Close()
	torn, err := OpenState(path)
	if err != nil || !torn.Has("uid-100") || torn.Has("uid-x") {
		t.Fatalf("journal with a torn last line: err %v, uid-100 %v, uid-x %v", err, torn.Has("uid-100"), torn.Has("uid-x"))
	}
	if err := torn.Put("uid-y", h, iptables.PodOptions{}); err != nil {
		t.Fatal(err)
	}
	torn.Close()
	if after, err := OpenState(path); err != nil || !after.Has("uid-y") || !after.Has("uid-0") {
		t.Errorf("after a change on a torn journal: err %v, uid-y %v", err, after.Has("uid-y"))
	}

	// An older agent's file.
	oldPath := filepath.Join(t.TempDir(), "old.json")
	if err := os.WriteFile(oldPath, []byte(fmt.Sprintf(`{"uid-old":{"path":"/proc/self/ns/net","inode":%d}}`, h.Inode())), 0o600); err != nil {
		t.Fatal(err)
	}
	old, err := OpenState(oldPath)
	if err != nil || !old.Has("uid-old") {
		t.Fatalf("older agent's file: err %v, has uid-old %v", err, old.Has("uid-old"))
	}
	if err := old.Put("uid-new", h, iptables.PodOptions{}); err != nil {
		t.Fatal(err)
	}
	old.Close()
	conv, err := OpenState(oldPath)
	if err != nil || !conv.Has("uid-old") || !conv.Has("uid-new") {
		t.Fatalf("older agent's file after a change: err %v, uid-old %v, uid-new %v", err, conv.Has("uid-old"), conv.Has("uid-new"))
	}
}
