// Package registry is the agent's record of the pods it has taken on: uid →
// pod identity, IPs, open network-namespace handle and lifecycle phase. It
// owns the netns handles: it closes a pod's handle when the pod leaves or its
// handle is replaced, and nobody else does.
//
// A pod's phase changes only through Update, and only along the moves
// listed in transitions.go. The registry is what a newly connected ztunnel
// gets as its snapshot, so a pod is in it from the moment its rules may be in
// place until it is released.
package registry

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"sync"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/podnetns"
)

// Entry is one pod. Netns may be nil when the agent restarted and could not
// find the pod's namespace: ztunnel is then told to keep the pod as it is.
// Callers get copies; they must not close Netns.
type Entry struct {
	UID            string
	Name           string
	Namespace      string
	ServiceAccount string
	IPs            []netip.Addr
	// LaggingAPIIPs are the addresses the API still showed for the pod
	// when a CNI ADD enrolled it in a new sandbox with others (IPs):
	// kubelet reports a sandbox's addresses only after its ADD returned,
	// so until the API shows anything else they are the old sandbox's,
	// not a sign of a newer one. Nil once the API caught up.
	LaggingAPIIPs []netip.Addr
	Netns         *podnetns.Handle
	Phase         Phase
	// Options are the capture options the pod's rules were programmed
	// (or last verified) with: an enrolled pod whose annotations turn
	// invalid is verified against these.
	Options iptables.PodOptions
	// LastError says why the pod is not (yet) enabled; empty when it is.
	// It is what a pod condition's message will carry.
	LastError string
	// Reason classifies LastError in one word (the pod condition's
	// reason, e.g. ZtunnelUnavailable); empty when it is not classified.
	Reason string
	// Gone marks a pod whose object or sandbox is gone: when it leaves
	// the registry there is nothing left to annotate.
	Gone bool
}

// ErrForbidden wraps a phase move that transitions.go does not allow.
var ErrForbidden = errors.New("phase transition not allowed")

// Registry is safe for concurrent use.
type Registry struct {
	mu      sync.Mutex
	entries map[string]*Entry
}

// New returns an empty registry.
func New() *Registry {
	return &Registry{entries: make(map[string]*Entry)}
}

// Update is the one way to change a pod. fn gets a copy of uid's entry (a
// zero Entry with UID set and Phase Absent when uid is not registered) and
// changes it; the result is stored when the phase move old → new is allowed
// (staying in a phase always is). Phase Absent removes the entry. The netns
// handle follows the entry: a handle fn replaced, or that leaves with the
// entry, is closed; a new handle in a refused update is closed too, so a
// handle never leaks. It returns the stored entry (a copy) and, for a refused
// move, an error wrapping ErrForbidden.
//
// The agent calls Update under its per-pod lock, so fn sees the pod as no
// other change can leave it meanwhile.
func (r *Registry) Update(uid string, fn func(*Entry)) (Entry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	old, ok := r.entries[uid]
	cur := Entry{UID: uid}
	if ok {
		cur = *old
		cur.IPs = slices.Clone(old.IPs)
	}
	next := cur
	fn(&next)
	next.UID = uid
	next.IPs = slices.Clone(next.IPs)
	if !canMove(cur.Phase, next.Phase) {
		if next.Netns != nil && next.Netns != cur.Netns {
			next.Netns.Close()
		}
		return cur, fmt.Errorf("pod %s/%s (uid %s): %s → %s: %w", cur.Namespace, cur.Name, uid, cur.Phase, next.Phase, ErrForbidden)
	}
	if cur.Netns != nil && cur.Netns != next.Netns {
		cur.Netns.Close()
	}
	if next.Phase == Absent {
		if next.Netns != nil {
			next.Netns.Close() // it leaves with the entry
		}
		delete(r.entries, uid)
		return Entry{UID: uid}, nil
	}
	r.entries[uid] = &next
	out := next
	out.IPs = slices.Clone(next.IPs)
	return out, nil
}

// Get returns a copy of the entry for uid.
func (r *Registry) Get(uid string) (Entry, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[uid]
	if !ok {
		return Entry{UID: uid}, false
	}
	out := *e
	out.IPs = slices.Clone(e.IPs)
	return out, true
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

// UIDs returns the registered uids in phase p.
func (r *Registry) UIDs(p Phase) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for uid, e := range r.entries {
		if e.Phase == p {
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

// Close removes every entry and closes every handle: the agent is stopping,
// so this is not a lifecycle move of any pod. The agent calls it at shutdown.
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
