package podnetns

import (
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
// runtime keeps no process in the sandbox netns. Every change rewrites the
// file atomically (temporary file, then rename).
type State struct {
	path string
	mu   sync.Mutex
	m    map[string]Record
}

// OpenState loads the state file at path (missing: empty). A file that
// cannot be parsed is an error, with an empty State that overwrites it at
// the first change, so a corrupt file costs only the fallback to /proc.
func OpenState(path string) (*State, error) {
	s := &State{path: path, m: map[string]Record{}}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("podnetns: read state %s: %w", path, err)
	}
	if err := json.Unmarshal(b, &s.m); err != nil {
		s.m = map[string]Record{}
		return s, fmt.Errorf("podnetns: parse state %s: %w", path, err)
	}
	return s, nil
}

// Put records uid's namespace as h, and the options its rules have.
func (s *State) Put(uid string, h *Handle, opts iptables.PodOptions) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.m[uid]; ok && r.Path == h.Path() && r.Inode == h.Inode() && r.Options != nil && *r.Options == opts {
		return nil
	}
	s.m[uid] = Record{Path: h.Path(), Inode: h.Inode(), Options: &opts}
	return s.writeLocked()
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
	return s.writeLocked()
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
	return dropped, s.writeLocked()
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

func (s *State) writeLocked() error {
	b, err := json.Marshal(maps.Clone(s.m))
	if err != nil {
		return fmt.Errorf("podnetns: encode state: %w", err)
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
	return nil
}
