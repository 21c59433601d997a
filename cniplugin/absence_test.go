package cniplugin

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniapi"
)

// The absence record stays bounded however long the agent is away, counts
// every ADD by decision, and keeps the last sign of an agent.
func TestAbsenceRecordIsBounded(t *testing.T) {
	dir := t.TempDir()
	renewed := time.Now().Add(-time.Hour).UTC()
	v := leaseVerdict{usable: true, lease: cniapi.InstallLease{Renewed: renewed}}
	for i := range 500 {
		d := absentDecision{pass: i%3 == 0, mesh: i%3 != 0, reason: fmt.Sprintf("reason %d", i)}
		if err := updateAbsence(dir, &cniapi.Pod{Namespace: "ns", Name: fmt.Sprintf("p%d", i)}, d, v); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, cniapi.AbsenceFile))
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > maxAbsenceSize {
		t.Fatalf("record of %d bytes, over its bound %d", len(b), maxAbsenceSize)
	}
	var r cniapi.AbsenceRecord
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if r.Passed != 167 || r.Refused != 333 || len(r.Waiting) != 333 || len(r.Recent) != cniapi.MaxAbsenceRecent || r.Recent[len(r.Recent)-1].Name != "p499" {
		t.Errorf("record: passed %d refused %d recent %d (last %+v)", r.Passed, r.Refused, len(r.Recent), r.Recent[len(r.Recent)-1])
	}
	if !r.AgentLastSeen.Equal(renewed) {
		t.Errorf("agent last seen %v, want the lease's renewal %v", r.AgentLastSeen, renewed)
	}
	// The same pod refused again counts as one waiting pod.
	for range 3 {
		if err := updateAbsence(dir, &cniapi.Pod{Namespace: "ns", Name: "p1"}, absentDecision{}, v); err != nil {
			t.Fatal(err)
		}
	}
	b, _ = os.ReadFile(filepath.Join(dir, cniapi.AbsenceFile))
	if err := json.Unmarshal(b, &r); err != nil || r.Refused != 336 || len(r.Waiting) != 333 {
		t.Errorf("a pod refused again: refused %d, waiting %d (%v)", r.Refused, len(r.Waiting), err)
	}
	// A record it cannot read starts anew instead of failing the ADD.
	if err := os.WriteFile(filepath.Join(dir, cniapi.AbsenceFile), []byte("\x00garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := updateAbsence(dir, &cniapi.Pod{Namespace: "ns", Name: "after"}, absentDecision{}, v); err != nil {
		t.Fatal(err)
	}
	b, _ = os.ReadFile(filepath.Join(dir, cniapi.AbsenceFile))
	if err := json.Unmarshal(b, &r); err != nil || r.Refused != 1 || r.Passed != 0 {
		t.Errorf("after garbage: %s (%v)", b, err)
	}
}
