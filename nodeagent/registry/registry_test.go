package registry

import (
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/ambientd/ambientd/nodeagent/podnetns"
)

// openHandle returns a real open netns handle (this process's own netns) so
// the test can observe whether the registry closed it.
func openHandle(t *testing.T) *podnetns.Handle {
	t.Helper()
	h, err := podnetns.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func isClosed(h *podnetns.Handle) bool { return h.Fd() == ^uintptr(0) }

// put stores e as it is (whatever its phase), as a rebuild or an enrollment does.
func put(t *testing.T, r *Registry, e Entry) {
	t.Helper()
	if _, err := r.Update(e.UID, func(cur *Entry) { *cur = e }); err != nil {
		t.Fatal(err)
	}
}

var phases = []Phase{Absent, Unverified, Pending, Enabled, Releasing, Uncaptured, Unserved}

// TestTransitions: every allowed move is stored, every other one is refused
// and leaves the entry as it was.
func TestTransitions(t *testing.T) {
	want := map[[2]Phase]bool{
		{Absent, Unverified}: true, {Absent, Pending}: true, {Absent, Enabled}: true, {Absent, Uncaptured}: true, {Absent, Unserved}: true,
		{Unverified, Pending}: true, {Unverified, Uncaptured}: true, {Unverified, Releasing}: true,
		{Pending, Enabled}: true, {Pending, Uncaptured}: true, {Pending, Releasing}: true,
		{Enabled, Pending}: true, {Enabled, Uncaptured}: true, {Enabled, Releasing}: true, {Enabled, Unserved}: true,
		{Unserved, Enabled}: true, {Unserved, Pending}: true, {Unserved, Uncaptured}: true, {Unserved, Releasing}: true,
		{Uncaptured, Pending}: true, {Uncaptured, Releasing}: true,
		{Releasing, Absent}: true,
	}
	for _, from := range phases {
		for _, to := range phases {
			ok := from == to || want[[2]Phase{from, to}]
			t.Run(from.String()+"→"+to.String(), func(t *testing.T) {
				if canMove(from, to) != ok {
					t.Fatalf("canMove(%v, %v) = %v, want %v", from, to, !ok, ok)
				}
				r := New()
				if from != Absent {
					r.entries["u"] = &Entry{UID: "u", Name: "p", Namespace: "n", Phase: from}
				}
				got, err := r.Update("u", func(e *Entry) { e.Phase = to })
				cur, registered := r.Get("u")
				switch {
				case ok && err != nil:
					t.Errorf("allowed move refused: %v", err)
				case ok && (got.Phase != to || cur.Phase != to || registered != (to != Absent)):
					t.Errorf("allowed move: returned %v, stored %v (registered %v), want %v", got.Phase, cur.Phase, registered, to)
				case !ok && !errors.Is(err, ErrForbidden):
					t.Errorf("forbidden move: err = %v, want ErrForbidden", err)
				case !ok && (cur.Phase != from || registered != (from != Absent)):
					t.Errorf("forbidden move changed the entry: phase %v registered %v, want %v", cur.Phase, registered, from)
				}
			})
		}
	}
}

func TestUpdateReplacesAndClosesOldHandle(t *testing.T) {
	r := New()
	a, b := openHandle(t), openHandle(t)
	put(t, r, Entry{UID: "u1", Name: "p", Namespace: "n", Netns: a, Phase: Pending})
	if _, err := r.Update("u1", func(e *Entry) { e.Netns, e.Phase = b, Enabled }); err != nil {
		t.Fatal(err)
	}
	if !isClosed(a) {
		t.Error("replaced handle not closed")
	}
	if isClosed(b) {
		t.Error("current handle closed")
	}
	e, ok := r.Get("u1")
	if !ok || e.Netns != b || e.Phase != Enabled {
		t.Errorf("Get = %+v, %v", e, ok)
	}
	// Keeping the same handle must not close it.
	if _, err := r.Update("u1", func(e *Entry) { e.LastError = "x" }); err != nil || isClosed(b) {
		t.Errorf("same handle: err %v closed %v", err, isClosed(b))
	}
}

func TestRefusedUpdateClosesNewHandle(t *testing.T) {
	r := New()
	a := openHandle(t)
	if _, err := r.Update("u", func(e *Entry) { e.Netns, e.Phase = a, Releasing }); !errors.Is(err, ErrForbidden) {
		t.Fatalf("absent → releasing: err = %v", err)
	}
	if !isClosed(a) || r.Len() != 0 {
		t.Errorf("refused update: handle closed %v, registry %d; want closed, empty", isClosed(a), r.Len())
	}
}

func TestReleaseAndClose(t *testing.T) {
	r := New()
	a, b := openHandle(t), openHandle(t)
	put(t, r, Entry{UID: "u1", Netns: a, Phase: Enabled})
	if _, err := r.Update("u1", func(e *Entry) { e.Phase = Releasing }); err != nil {
		t.Fatal(err)
	}
	put(t, r, Entry{UID: "u2", Netns: b, Phase: Enabled})
	put(t, r, Entry{UID: "u3", Phase: Enabled}) // Keep entry without handle
	if _, err := r.Update("u1", func(e *Entry) { e.Phase = Absent }); err != nil || !isClosed(a) || r.Len() != 2 {
		t.Errorf("release: err %v closed %v len %d", err, isClosed(a), r.Len())
	}
	r.Close()
	if !isClosed(b) || r.Len() != 0 {
		t.Errorf("Close: closed=%v len=%d", isClosed(b), r.Len())
	}
}

func TestListSortedAndPhases(t *testing.T) {
	r := New()
	ip := netip.MustParseAddr("10.0.0.1")
	ips := []netip.Addr{ip}
	put(t, r, Entry{UID: "3", Namespace: "b", Name: "x", Phase: Pending})
	put(t, r, Entry{UID: "1", Namespace: "a", Name: "y", IPs: ips, Phase: Enabled})
	put(t, r, Entry{UID: "2", Namespace: "a", Name: "x", Phase: Pending})
	ips[0] = netip.MustParseAddr("10.9.9.9") // caller's slice must not alias
	var got []string
	for _, e := range r.List() {
		got = append(got, e.UID)
	}
	if want := []string{"2", "1", "3"}; !slices.Equal(got, want) {
		t.Errorf("List order = %v, want %v", got, want)
	}
	if e, _ := r.Get("1"); e.IPs[0] != ip {
		t.Errorf("IPs aliased caller slice: %v", e.IPs)
	}
	if got := r.UIDs(Pending); !slices.Equal(got, []string{"2", "3"}) {
		t.Errorf("UIDs(Pending) = %v", got)
	}
	if _, err := r.Update("2", func(e *Entry) { e.Phase = Enabled }); err != nil {
		t.Fatal(err)
	}
	if got := r.UIDs(Enabled); !slices.Equal(got, []string{"1", "2"}) {
		t.Errorf("UIDs(Enabled) = %v", got)
	}
	if got := r.FindByName("a", "x"); !slices.Equal(got, []string{"2"}) {
		t.Errorf("FindByName = %v", got)
	}
}

// The probe rule: an entry exactly while the rules are in the current
// sandbox.
func TestProbeEntry(t *testing.T) {
	for _, p := range phases {
		if got, want := ProbeEntry(p), p == Pending || p == Enabled || p == Unserved; got != want {
			t.Errorf("ProbeEntry(%v) = %v, want %v", p, got, want)
		}
		if p.String() == "unknown" {
			t.Errorf("phase %d has no name", p)
		}
	}
}
