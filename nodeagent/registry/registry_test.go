package registry

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
)

// openFile returns a real open file so the test can observe whether the
// registry closed it.
func openFile(t *testing.T) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "ns"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func isClosed(f *os.File) bool {
	_, err := f.Stat()
	return errors.Is(err, os.ErrClosed)
}

func TestPutReplacesAndClosesOldHandle(t *testing.T) {
	r := New()
	a, b := openFile(t), openFile(t)
	r.Put(Entry{UID: "u1", Name: "p", Namespace: "n", Netns: a})
	r.Put(Entry{UID: "u1", Name: "p", Namespace: "n", Netns: b, State: Enabled})
	if !isClosed(a) {
		t.Error("replaced handle not closed")
	}
	if isClosed(b) {
		t.Error("current handle closed")
	}
	e, ok := r.Get("u1")
	if !ok || e.Netns != b || e.State != Enabled {
		t.Errorf("Get = %+v, %v", e, ok)
	}
}

func TestPutNilNetnsKeepsHandle(t *testing.T) {
	r := New()
	a := openFile(t)
	r.Put(Entry{UID: "u1", Netns: a})
	r.Put(Entry{UID: "u1", State: Enabled})
	e, _ := r.Get("u1")
	if e.Netns != a || isClosed(a) {
		t.Errorf("handle dropped: %+v closed=%v", e, isClosed(a))
	}
	// Re-putting the same handle must not close it.
	r.Put(Entry{UID: "u1", Netns: a})
	if isClosed(a) {
		t.Error("same handle closed on re-put")
	}
}

func TestDeleteAndClose(t *testing.T) {
	r := New()
	a, b := openFile(t), openFile(t)
	r.Put(Entry{UID: "u1", Netns: a})
	r.Put(Entry{UID: "u2", Netns: b})
	r.Put(Entry{UID: "u3"}) // Keep entry without handle
	if !r.Delete("u1") || !isClosed(a) {
		t.Error("Delete did not remove/close")
	}
	if r.Delete("u1") {
		t.Error("second Delete reported true")
	}
	r.Close()
	if !isClosed(b) || r.Len() != 0 {
		t.Errorf("Close: closed=%v len=%d", isClosed(b), r.Len())
	}
}

func TestSetNetnsUnknownClosesHandle(t *testing.T) {
	r := New()
	a := openFile(t)
	if r.SetNetns("nope", a) {
		t.Error("SetNetns on unknown uid reported true")
	}
	if !isClosed(a) {
		t.Error("handle for unknown uid leaked")
	}
	b, c := openFile(t), openFile(t)
	r.Put(Entry{UID: "u"})
	r.SetNetns("u", b)
	r.SetNetns("u", c)
	if !isClosed(b) || isClosed(c) {
		t.Errorf("closed b=%v c=%v", isClosed(b), isClosed(c))
	}
}

func TestListSortedAndStates(t *testing.T) {
	r := New()
	ip := netip.MustParseAddr("10.0.0.1")
	ips := []netip.Addr{ip}
	r.Put(Entry{UID: "3", Namespace: "b", Name: "x"})
	r.Put(Entry{UID: "1", Namespace: "a", Name: "y", IPs: ips, State: Enabled})
	r.Put(Entry{UID: "2", Namespace: "a", Name: "x"})
	ips[0] = netip.MustParseAddr("10.9.9.9") // caller's slice must not alias
	var got []string
	for _, e := range r.List() {
		got = append(got, e.UID)
	}
	if want := []string{"2", "1", "3"}; !equal(got, want) {
		t.Errorf("List order = %v, want %v", got, want)
	}
	if e, _ := r.Get("1"); e.IPs[0] != ip {
		t.Errorf("IPs aliased caller slice: %v", e.IPs)
	}
	if got := r.UIDs(Pending); !equal(got, []string{"2", "3"}) {
		t.Errorf("UIDs(Pending) = %v", got)
	}
	if !r.SetState("2", Enabled) || r.SetState("nope", Enabled) {
		t.Error("SetState result wrong")
	}
	if got := r.UIDs(Enabled); !equal(got, []string{"1", "2"}) {
		t.Errorf("UIDs(Enabled) = %v", got)
	}
	if got := r.FindByName("a", "x"); !equal(got, []string{"2"}) {
		t.Errorf("FindByName = %v", got)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestSetRulesVerified(t *testing.T) {
	r := New()
	f := openFile(t)
	r.Put(Entry{UID: "u1", Name: "p", Namespace: "n", Netns: f, RulesUnverified: true})
	if e, _ := r.Get("u1"); !e.RulesUnverified {
		t.Fatal("RulesUnverified not recorded")
	}
	if !r.SetRulesVerified("u1") {
		t.Fatal("SetRulesVerified of a registered uid = false")
	}
	if e, _ := r.Get("u1"); e.RulesUnverified || e.Netns != f || isClosed(f) {
		t.Errorf("after SetRulesVerified: %+v (handle closed %v), want verified with the same open handle", e, isClosed(f))
	}
	if r.SetRulesVerified("nope") {
		t.Error("SetRulesVerified of an unknown uid = true")
	}
}

func TestSetStateIf(t *testing.T) {
	for _, tc := range []struct {
		name      string
		from, to  State
		have      State
		known     bool
		wantMoved bool
		wantState State
	}{
		{name: "matching state moves", have: Enabled, known: true, from: Enabled, to: Pending, wantMoved: true, wantState: Pending},
		{name: "other state stays", have: Pending, known: true, from: Enabled, to: Pending, wantMoved: false, wantState: Pending},
		{name: "unknown pod", known: false, from: Enabled, to: Pending, wantMoved: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			if tc.known {
				r.Put(Entry{UID: "u", State: tc.have})
			}
			if got := r.SetStateIf("u", tc.from, tc.to); got != tc.wantMoved {
				t.Errorf("SetStateIf = %v, want %v", got, tc.wantMoved)
			}
			if e, ok := r.Get("u"); ok != tc.known || (ok && e.State != tc.wantState) {
				t.Errorf("after: %+v known=%v, want state %v known=%v", e, ok, tc.wantState, tc.known)
			}
		})
	}
}
