// Package registry is the agent's record of enrolled pods: uid → pod identity,
// IPs, open network-namespace handle and enrollment state. It owns the netns
// file descriptors: it closes a pod's handle when the pod is removed or its
// handle replaced, and nobody else does.
//
// The registry is what a newly connected ztunnel gets as its snapshot, so a pod
// must be in it from the moment its rules are in place until it is removed.
package registry

import (
	"net/netip"
	"os"
	"slices"
	"sort"
	"sync"
)

// State is a pod's enrollment state, mirrored in the
// ambient.istio.io/redirection annotation.
type State int

const (
	// Pending: rules are in place, ztunnel has not acked the pod yet.
	Pending State = iota
	// Enabled: ztunnel acked the pod and its IPs are in the probe set.
	Enabled
)

func (s State) String() string {
	switch s {
	case Pending:
		return "pending"
	case Enabled:
		return "enabled"
	}
	return "unknown"
}

// Entry is one enrolled pod. Netns may be nil when the agent restarted and
// could not find the pod's namespace: ztunnel is then told to keep the pod as
// it is. Callers get copies; they must not close Netns.
type Entry struct {
	UID            string
	Name           string
	Namespace      string
	ServiceAccount string
	IPs            []netip.Addr
	Netns          *os.File
	State          State
	// RulesUnverified marks a pod restored after a restart only because the
	// policy puts it in the mesh and its netns was found (it carried no
	// redirection annotation, e.g. the agent died before that patch landed):
	// its rules may or may not be in place, so the next reconcile applies
	// them (idempotently) before telling ztunnel again.
	RulesUnverified bool
	// Releasing marks a pod being taken out of the mesh: its rules are gone
	// (or it is) and ztunnel is being told to drop it. It is left out of
	// snapshots, so a ztunnel that connects meanwhile never gets it.
	Releasing bool
}

// Registry is safe for concurrent use.
type Registry struct {
	mu      sync.Mutex
	entries map[string]*Entry
}

// New returns an empty registry.
func New() *Registry {
	return &Registry{entries: make(map[string]*Entry)}
}

// Put records e, replacing any entry with the same UID. When the replaced
// entry held a different netns handle, that handle is closed; when e.Netns is
// nil the existing handle is kept (a restart re-registering a pod it could not
// find must not drop a handle it already has).
func (r *Registry) Put(e Entry) {
	e.IPs = slices.Clone(e.IPs)
	r.mu.Lock()
	defer r.mu.Unlock()
	if old, ok := r.entries[e.UID]; ok {
		switch {
		case e.Netns == nil:
			e.Netns = old.Netns
		case old.Netns != nil && old.Netns != e.Netns:
			old.Netns.Close()
		}
	}
	r.entries[e.UID] = &e
}

// Get returns a copy of the entry for uid.
func (r *Registry) Get(uid string) (Entry, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if !ok {
		return Entry{}, false
	}
	return *e, true
}

// SetState changes the state of uid and reports whether uid is registered.
func (r *Registry) SetState(uid string, s State) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if ok {
		e.State = s
	}
	return ok
}

// SetStateIf moves uid from state from to state to, atomically; it reports
// whether it did (false when the pod is unknown or in another state).
func (r *Registry) SetStateIf(uid string, from, to State) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if !ok || e.State != from {
		return false
	}
	e.State = to
	return true
}

// SetReleasing marks uid as Releasing and reports whether it is registered.
func (r *Registry) SetReleasing(uid string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if ok {
		e.Releasing = true
	}
	return ok
}

// SetRulesVerified clears RulesUnverified of uid (its rules were just
// applied) and reports whether uid is registered.
func (r *Registry) SetRulesVerified(uid string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if ok {
		e.RulesUnverified = false
	}
	return ok
}

// SetNetns gives uid a netns handle (found later, e.g. by a /proc scan), closing
// any previous different one. If uid is not registered, f is closed and false
// returned, so a handle never leaks.
func (r *Registry) SetNetns(uid string, f *os.File) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if !ok {
		f.Close()
		return false
	}
	if e.Netns != nil && e.Netns != f {
		e.Netns.Close()
	}
	e.Netns = f
	return true
}

// Delete removes uid and closes its netns handle. It reports whether uid was
// registered.
func (r *Registry) Delete(uid string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if !ok {
		return false
	}
	if e.Netns != nil {
		e.Netns.Close()
	}
	delete(r.entries, uid)
	return true
}

// List returns copies of all entries, sorted by namespace, name, uid so
// snapshots and logs are deterministic.
func (r *Registry) List() []Entry {
	r.mu.Lock()
	out := make([]Entry, 0, len(r.entries))
	for _, e := range r.entries {
		out = append(out, *e)
	}
	r.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		return a.UID < b.UID
	})
	return out
}

// UIDs returns the registered uids in the given state.
func (r *Registry) UIDs(s State) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for uid, e := range r.entries {
		if e.State == s {
			out = append(out, uid)
		}
	}
	sort.Strings(out)
	return out
}

// FindByName returns the uids registered under namespace/name (more than one
// when a pod was recreated under the same name before the old one was removed).
func (r *Registry) FindByName(namespace, name string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for uid, e := range r.entries {
		if e.Namespace == namespace && e.Name == name {
			out = append(out, uid)
		}
	}
	sort.Strings(out)
	return out
}

// Len returns the number of registered pods.
func (r *Registry) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.entries)
}

// Close removes every entry and closes every handle. The agent calls it at
// shutdown.
func (r *Registry) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for uid, e := range r.entries {
		if e.Netns != nil {
			e.Netns.Close()
		}
		delete(r.entries, uid)
	}
}
