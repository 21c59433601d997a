package podnetns

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/ambientd/ambientd/iptables"
)

// Record is where a pod's network namespace was when its CNI ADD came: the
// runtime's netns path and the namespace's inode (which tells a reused path
// from the same namespace).
type Record struct {
	Path  string `json:"path"`
	Inode uint64 `json:"inode"`
	// Options are the capture options the pod's rules were programmed
	// with, so a restarted agent verifies a pod whose annotations turned
	// invalid against what it has (nil in files of older agents).
	Options *iptables.PodOptions `json:"options,omitempty"`
}

// State is a small file of Records by pod uid. It lives in the agent's run
// directory (tmpfs): after a reboot it is gone, as the namespaces are. On a
// restart it is tried before the /proc scan, which cannot find pods whose
// runtime keeps no process in the sandbox netns.
//
// The file is a journal, one JSON line per change ({"uid":…,"record":…};
// no record: deleted), so a pod's CNI ADD appends one line in one write
// instead of rewriting every pod's record. When the journal holds more
// than twice the live records (plus a margin) it is compacted: rewritten
// atomically (temporary file, then rename) with one line per live record.
// A file of older agents (one JSON object of records by uid) is read, and
// replaced by a journal at the first change.
type State struct {
	path string
	mu   sync.Mutex
	m    map[string]Record
	// f is the journal open for appending (nil: the next change compacts),
	// lines how many lines it holds.
	f     *os.File
	lines int
}

// change is one journal line.
type change struct {
	UID    string  `json:"uid"`
	Record *Record `json:"record,omitempty"`
}

// compactMargin is how many superseded lines the journal may hold beyond
// the live records before it is compacted.
const compactMargin = 64

// OpenState loads the state file at path (missing: empty). A file that
// cannot be parsed is an error, with an empty State that overwrites it at
// the first change, so a corrupt file costs only the fallback to /proc. A
// last line cut short after good ones (the agent died in its write) is
// dropped.
func OpenState(path string) (*State, error) {
	s := &State{path: path, m: map[string]Record{}}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("podnetns: read state %s: %w", path, err)
	}
	var old map[string]Record
	if json.Unmarshal(b, &old) == nil {
		if old != nil {
			s.m = old
		}
		return s, nil // an older agent's file: the first change compacts
	}
	lines := bytes.Split(b, []byte("\n"))
	read := 0
	for i, l := range lines {
		if len(bytes.TrimSpace(l)) == 0 {
			continue
		}
		var c change
		if err := json.Unmarshal(l, &c); err != nil || c.UID == "" {
			if i == len(lines)-1 && read > 0 {
				break // an append cut short: the first change compacts
			}
			s.m = map[string]Record{}
			return s, fmt.Errorf("podnetns: parse state %s line %d: %w", path, i+1, errors.Join(err, errNoUID(c.UID)))
		}
		read++
		if c.Record == nil {
			delete(s.m, c.UID)
		} else {
			s.m[c.UID] = *c.Record
		}
	}
	return s, nil
}

func errNoUID(uid string) error {
	if uid == "" {
		return errors.New("a change without a uid")
	}
	return nil
}

// Put records uid's namespace as h, and the options its rules have.
func (s *State) Put(uid string, h *Handle, opts iptables.PodOptions) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.m[uid]; ok && r.Path == h.Path() && r.Inode == h.Inode() && r.Options != nil && *r.Options == opts {
		return nil
	}
	r := Record{Path: h.Path(), Inode: h.Inode(), Options: &opts}
	s.m[uid] = r
	return s.appendLocked(change{UID: uid, Record: &r})
}

// Options returns the capture options recorded for uid.
func (s *State) Options(uid string) (iptables.PodOptions, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.m[uid]
	if !ok || r.Options == nil {
		return iptables.PodOptions{}, false
	}
	return *r.Options, true
}

// Delete forgets uid.
func (s *State) Delete(uid string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[uid]; !ok {
		return nil
	}
	delete(s.m, uid)
	return s.appendLocked(change{UID: uid})
}

// Has reports whether uid has a record.
func (s *State) Has(uid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[uid]
	return ok
}

// Retain drops the records of every uid keep rejects (pods deleted while
// the agent was down) and returns them.
func (s *State) Retain(keep func(uid string) bool) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var dropped []string
	for uid := range s.m {
		if !keep(uid) {
			dropped = append(dropped, uid)
			delete(s.m, uid)
		}
	}
	if len(dropped) == 0 {
		return nil, nil
	}
	slices.Sort(dropped)
	return dropped, s.compactLocked()
}

// Open opens the namespace recorded for uid, only if the path still holds
// the same namespace (same inode); ok is false otherwise. The same inode
// does not prove the same sandbox (inode numbers are reused): the caller
// checks the namespace further (Finder.Accept).
func (s *State) Open(uid string) (*Handle, bool) {
	s.mu.Lock()
	r, ok := s.m[uid]
	s.mu.Unlock()
	if !ok {
		return nil, false
	}
	h, err := Open(r.Path)
	if err != nil {
		return nil, false
	}
	if h.Inode() != r.Inode {
		h.Close()
		return nil, false
	}
	return h, true
}

// appendLocked writes c to the journal in one write, or compacts the
// journal (which then holds c) when it is not open or too long.
func (s *State) appendLocked(c change) error {
	if s.f == nil || s.lines >= 2*len(s.m)+compactMargin {
		return s.compactLocked()
	}
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("podnetns: encode state: %w", err)
	}
	if _, err := s.f.Write(append(b, '\n')); err != nil {
		s.closeLocked() // a failed or short write: the next change compacts
		return fmt.Errorf("podnetns: append to state %s: %w", s.path, err)
	}
	s.lines++
	return nil
}

// compactLocked replaces the file with one line per live record and opens
// it for appending.
func (s *State) compactLocked() error {
	s.closeLocked()
	var b []byte
	for _, uid := range slices.Sorted(maps.Keys(s.m)) {
		r := s.m[uid]
		l, err := json.Marshal(change{UID: uid, Record: &r})
		if err != nil {
			return fmt.Errorf("podnetns: encode state: %w", err)
		}
		b = append(append(b, l...), '\n')
	}
	if err := os.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return fmt.Errorf("podnetns: state dir: %w", err)
	}
	tmp := s.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("podnetns: write state %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, s.path); err != nil {
		return fmt.Errorf("podnetns: replace state %s: %w", s.path, err)
	}
	f, err := os.OpenFile(s.path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("podnetns: open state %s: %w", s.path, err)
	}
	s.f, s.lines = f, len(s.m)
	return nil
}

func (s *State) closeLocked() {
	if s.f != nil {
		s.f.Close()
		s.f = nil
	}
}

// Close closes the journal; a later change opens it again.
func (s *State) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeLocked()
	return nil
}
